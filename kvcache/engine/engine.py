"""CacheEngine: the in-process library API — register, lookup, store, retrieve — over L1 + L2.

The one place that ties keys, the L1 pool, the L2 tiers and the transfer contexts together;
everything it does is published on the event sink it was given (``NullEventSink`` by default,
so the engine behaves the same with observability off).

Policies, stated once:

* **Only full chunks** are stored and looked up; a trailing partial chunk is ignored.
* **Write-through:** every chunk newly written to L1 is also queued to every L2 tier; the L1
  slot stays pinned until each write finishes. A tier that is down or saturated drops the write
  (counted), so a slow tier never slows a store.
* **Lookup** counts the L1 prefix, then the continuation present in L2 (disk first, then Redis),
  and starts loading that continuation into L1 (prefetch) before it returns; ``retrieve`` waits
  for those loads. The first missing chunk ends the prefix.
* **Concurrency:** the L1 lock covers bookkeeping only; copies run unlocked on pinned slots, so a
  lookup never waits behind another thread's copy.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvcache.config import EngineConfig
from kvcache.context import GPUCacheContext
from kvcache.engine.instance import Instance
from kvcache.engine.stats import OffloadStats, OffloadStatsCollector
from kvcache.errors import BlockIdError, ChunkMismatchError, LayoutError, UnknownInstanceError
from kvcache.layouts import GPUKVFormat, KVCaches
from kvcache.observability.event import (
    BlockAllocationRecord,
    Event,
    EventSink,
    EventType,
    NullEventSink,
)
from kvcache.storage.factory import create_policy, l2_adapters_from_config
from kvcache.storage.l1_pool import L1Entry, L1Pool
from kvcache.storage.l2_async import AsyncL2

logger = logging.getLogger(__name__)

#: Token and block ids: a list, or a numpy int array (the daemon decodes packed arrays).
IntArray = Sequence[int] | np.ndarray


class StoreResult(msgspec.Struct, frozen=True):
    """What a store did, in chunks; ``stored_tokens`` are the tokens newly written."""

    stored_chunks: int = 0
    skipped_chunks: int = 0
    failed_chunks: int = 0
    stored_tokens: int = 0


class CacheEngine:
    """Offloads registered engine KV caches to L1 (CPU) and L2 (disk, Redis). Thread-safe."""

    def __init__(self, config: EngineConfig, bus: EventSink | None = None) -> None:
        self.config = config
        self._bus: EventSink = bus if bus is not None else NullEventSink()
        self._pool = L1Pool(
            config.l1_size_bytes,
            watermark=config.l1_evict_watermark,
            extent_bytes=config.l1_extent_bytes,
            pin_memory=config.l1_pin_memory,
            policy=create_policy("lru"),
            bus=self._bus,
        )
        self._tiers = [
            AsyncL2(
                adapter,
                workers=config.l2_workers,
                max_inflight=config.l2_max_inflight,
                retry_interval_s=config.l2_retry_interval_s,
                bus=self._bus,
            )
            for adapter in l2_adapters_from_config(config, self._bus)
        ]
        self._stats = OffloadStatsCollector()
        self._instances: dict[int, Instance] = {}
        self._lock = threading.Lock()
        self._ops = itertools.count()
        self._closed = False

    # -- registration ---------------------------------------------------------------------
    def register(
        self,
        instance_id: int,
        model_name: str,
        kv_caches: KVCaches,
        *,
        engine: str = "vllm",
        fmt: GPUKVFormat | None = None,
        block_size: int | None = None,
    ) -> GPUCacheContext:
        """Register an engine's KV tensors; the chunk size comes from the config."""
        with self._lock:
            if instance_id in self._instances:
                raise LayoutError(f"instance {instance_id} is already registered; unregister it first")
            ctx = GPUCacheContext(
                kv_caches, chunk_size=self.config.chunk_size, fmt=fmt, engine=engine, block_size=block_size
            )
            self._instances[instance_id] = Instance(instance_id, model_name, ctx)
        return ctx

    def unregister(self, instance_id: int) -> None:
        with self._lock:
            if self._instances.pop(instance_id, None) is None:
                raise UnknownInstanceError(f"instance {instance_id} is not registered")

    def _instance(self, instance_id: int) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstanceError(f"instance {instance_id} is not registered") from None

    # -- lookup ---------------------------------------------------------------------------
    def lookup(
        self, instance_id: int, token_ids: IntArray, *, cache_salt: str = "", request_id: str = ""
    ) -> int:
        """Tokens of the longest cached prefix (whole chunks); starts L2 -> L1 prefetch of it."""
        inst = self._instance(instance_id)
        sid = request_id or self._op_id(instance_id)
        num_tokens = len(token_ids)
        self._publish(EventType.MP_LOOKUP_START, sid, inst.meta(num_tokens=num_tokens))
        keys = inst.keys(token_ids, cache_salt)
        l1 = self._pool.prefix(keys)
        l2 = self._prefetch(inst, keys[l1:])
        cs = self.config.chunk_size
        hit = (l1 + l2) * cs
        self._stats.record_lookup(num_tokens, hit)
        meta = inst.meta(num_tokens=num_tokens, hit_tokens=hit, l1_hit_tokens=l1 * cs, l2_hit_tokens=l2 * cs)
        self._publish(EventType.MP_LOOKUP_END, sid, meta)
        return hit

    def _prefetch(self, inst: Instance, keys: Sequence[int]) -> int:
        """Start loading the leading ``keys`` found in L2 into L1; returns how many started."""
        if not keys or not self._tiers:
            return 0
        source: list[AsyncL2 | None] = [None] * len(keys)
        for tier in self._tiers:
            missing = [i for i, s in enumerate(source) if s is None]
            if not missing:
                break
            for i, present in zip(missing, tier.contains([keys[i] for i in missing]), strict=True):
                if present:
                    source[i] = tier
        n = next((i for i, s in enumerate(source) if s is None), len(keys))
        entries = self._pool.begin_load(inst.geometry, keys[:n])
        for i, entry in enumerate(entries):
            src = source[i]
            assert src is not None

            def done(ok: bool, entry: L1Entry = entry) -> None:
                self._pool.finish([entry], ok)

            if not src.submit_load(entry.key, entry.tensor, done):
                self._pool.finish(entries[i:], False)
                return i
        return len(entries)

    # -- store ----------------------------------------------------------------------------
    def store(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
    ) -> StoreResult:
        """Copy the full chunks of ``token_ids`` (held in ``block_ids``) into the cache.

        Chunks already cached are skipped; when memory runs out the leading chunks that fit are
        stored and the rest reported as failed. ``block_hashes`` (the engine's own per-block
        hashes) are passed through on the end event for KV-event publishers.
        """
        inst = self._instance(instance_id)
        ctx = inst.ctx
        num_tokens = len(token_ids)
        self._check_cover(ctx, num_tokens, block_ids)
        keys = inst.keys(token_ids, cache_salt)
        ids = self._block_ids(ctx, block_ids, len(keys) * ctx.blocks_per_chunk)
        sid = request_id or self._op_id(instance_id)
        self._publish(EventType.MP_STORE_START, sid, inst.meta(num_tokens=num_tokens, num_chunks=len(keys)))
        res = self._pool.begin_write(inst.geometry, keys) if keys else None
        new = [e for _, e in res.new] if res else []
        elapsed = 0.0
        if new:
            assert res is not None
            bpc = ctx.blocks_per_chunk
            sel = np.concatenate([ids[i * bpc : (i + 1) * bpc] for i, _ in res.new])
            t0 = time.perf_counter()
            try:
                ctx.copy_to_chunks(sel, [e.tensor for e in new])
            except Exception:
                self._pool.finish(new, False)
                self._publish_store_end(
                    inst, sid, num_tokens, StoreResult(failed_chunks=len(keys)), 0, 0.0, False
                )
                raise
            elapsed = time.perf_counter() - t0
            for _tier in self._tiers:  # the write-through pins, taken before the slots go public
                self._pool.pin(new)
            extra = None
            if block_hashes is not None:
                extra = _engine_block_metadata(
                    [i for i, _ in res.new],
                    bpc,
                    ctx.block_size,
                    self.config.chunk_size,
                    block_hashes,
                    token_ids,
                )
            self._pool.finish(new, True, extra)
            self._write_through(new)
        cs = self.config.chunk_size
        result = StoreResult(
            stored_chunks=len(new),
            skipped_chunks=len(res.present) if res else 0,
            failed_chunks=res.failed if res else 0,
            stored_tokens=len(new) * cs,
        )
        nbytes = len(new) * inst.geometry.nbytes
        self._stats.record_store(nbytes, elapsed, result.stored_tokens)
        self._publish_store_end(inst, sid, num_tokens, result, nbytes, elapsed, True, block_hashes)
        return result

    def _write_through(self, entries: list[L1Entry]) -> None:
        for tier in self._tiers:
            for entry in entries:

                def done(ok: bool, entry: L1Entry = entry) -> None:
                    self._pool.release([entry])

                if not tier.submit_store(entry.key, entry.tensor, done):
                    self._pool.release([entry])

    def _publish_store_end(
        self,
        inst: Instance,
        sid: str,
        num_tokens: int,
        r: StoreResult,
        nbytes: int,
        seconds: float,
        success: bool,
        block_hashes: Sequence[int] | None = None,
    ) -> None:
        meta = inst.meta(
            num_tokens=num_tokens,
            stored_chunks=r.stored_chunks,
            skipped_chunks=r.skipped_chunks,
            failed_chunks=r.failed_chunks,
            stored_tokens=r.stored_tokens,
            num_bytes=nbytes,
            transfer_seconds=seconds,
            success=success,
        )
        if block_hashes is not None:
            meta["block_hashes"] = list(block_hashes)
        self._publish(EventType.MP_STORE_END, sid, meta)

    # -- retrieve -------------------------------------------------------------------------
    def retrieve(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
    ) -> int:
        """Copy the cached prefix of ``token_ids`` into ``block_ids``, leaving the first
        ``skip_tokens`` (rounded down to whole blocks) alone; returns the prefix length now
        valid in the engine (skip + copied)."""
        inst = self._instance(instance_id)
        ctx = inst.ctx
        num_tokens = len(token_ids)
        self._check_cover(ctx, num_tokens, block_ids)
        if skip_tokens < 0:
            raise ChunkMismatchError(f"skip_tokens must be >= 0, got {skip_tokens}")
        bs, bpc, cs = ctx.block_size, ctx.blocks_per_chunk, self.config.chunk_size
        if skip_tokens % bs:
            logger.info(
                "retrieve: skip_tokens=%d is not a multiple of block size %d; rounded down", skip_tokens, bs
            )
        skip_blocks = skip_tokens // bs
        skip = skip_blocks * bs
        keys = inst.keys(token_ids, cache_salt)
        ids = self._block_ids(ctx, block_ids, len(keys) * bpc)
        sid = request_id or self._op_id(instance_id)
        self._publish(EventType.MP_RETRIEVE_START, sid, inst.meta(num_tokens=num_tokens, skip_tokens=skip))
        first = skip_blocks // bpc  # the first chunk with a block to copy
        good = self._acquire_ready(inst, keys[first:]) if first < len(keys) else []
        copied = nbytes = l2_tokens = 0
        elapsed = 0.0
        if good:
            local_skip = skip_blocks - first * bpc
            sel = ids[first * bpc : (first + len(good)) * bpc]
            t0 = time.perf_counter()
            try:
                ctx.copy_from_chunks([e.tensor for e in good], sel, skip_blocks=local_skip)
            except Exception:
                self._pool.release(good)
                self._publish_retrieve_end(inst, sid, num_tokens, skip, skip, 0, 0, 0, 0.0, False)
                raise
            elapsed = time.perf_counter() - t0
            copied = len(good) * cs - local_skip * bs
            nbytes = copied * ctx.bytes_per_token
            l2_tokens = sum(cs for e in good if e.from_l2)
            for e in good:
                e.from_l2 = False
            self._pool.release(good, read_bytes=nbytes)
        retrieved = skip + copied
        self._stats.record_load(nbytes, elapsed, copied)
        self._publish_retrieve_end(
            inst,
            sid,
            num_tokens,
            skip,
            retrieved,
            max(0, copied - l2_tokens),
            l2_tokens,
            nbytes,
            elapsed,
            True,
        )
        return retrieved

    def _acquire_ready(self, inst: Instance, keys: Sequence[int]) -> list[L1Entry]:
        """Pin the leading chunks of ``keys`` that are (or can be brought) in L1 and wait for
        any load still running; the first miss or failed load ends the list."""
        entries = self._pool.acquire(keys)
        if len(entries) < len(keys) and self._prefetch(inst, keys[len(entries) :]):
            entries += self._pool.acquire(keys[len(entries) :])
        deadline = time.monotonic() + self.config.retrieve_wait_timeout_s
        for i, entry in enumerate(entries):
            if not entry.wait(max(0.0, deadline - time.monotonic())):
                self._pool.release(entries[i:])
                return entries[:i]
        return entries

    def _publish_retrieve_end(
        self,
        inst: Instance,
        sid: str,
        num_tokens: int,
        skip: int,
        retrieved: int,
        l1_tokens: int,
        l2_tokens: int,
        nbytes: int,
        seconds: float,
        success: bool,
    ) -> None:
        meta = inst.meta(
            num_tokens=num_tokens,
            skip_tokens=skip,
            retrieved_tokens=retrieved,
            l1_tokens=l1_tokens,
            l2_tokens=l2_tokens,
            missing_tokens=max(0, num_tokens - retrieved),
            num_bytes=nbytes,
            transfer_seconds=seconds,
            success=success,
        )
        self._publish(EventType.MP_RETRIEVE_END, sid, meta)

    # -- engine bookkeeping events ----------------------------------------------------------
    def report_block_allocations(self, instance_id: int, records: list[BlockAllocationRecord]) -> None:
        inst = self._instance(instance_id)
        meta = {
            "instance_id": instance_id,
            "model_name": inst.model_name,
            "records": list(records),
            "block_size": inst.ctx.block_size,  # lets L0 lifecycle tell the blocks of a record apart
        }
        self._bus.publish(Event(EventType.MP_VLLM_BLOCK_ALLOCATION, meta))

    def end_session(self, instance_id: int, request_id: str) -> None:
        inst = self._instance(instance_id)
        meta = {"instance_id": instance_id, "model_name": inst.model_name, "request_id": request_id}
        self._bus.publish(Event(EventType.MP_VLLM_END_SESSION, meta, session_id=request_id))

    # -- introspection --------------------------------------------------------------------
    def stats_snapshot(self) -> OffloadStats:
        """Offload activity since the previous call (snapshot-and-reset)."""
        return self._stats.snapshot()

    def status(self) -> dict[str, Any]:
        instances = [inst.info() for inst in list(self._instances.values())]
        return {
            "chunk_size": self.config.chunk_size,
            "instances": instances,
            "l1": self._pool.info(),
            "l2": [tier.info() for tier in self._tiers],
        }

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued L2 writes and loads; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for tier in self._tiers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = tier.flush(left) and ok
        return ok

    def close(self) -> None:
        """Finish pending L2 writes and close the tiers; idempotent."""
        if self._closed:
            return
        self._closed = True
        for tier in self._tiers:
            tier.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------
    def _op_id(self, instance_id: int) -> str:
        return f"{instance_id}-{next(self._ops)}"

    def _publish(self, etype: EventType, sid: str, meta: dict[str, Any]) -> None:
        self._bus.publish(Event(etype, meta, session_id=sid))

    @staticmethod
    def _check_cover(ctx: GPUCacheContext, num_tokens: int, block_ids: IntArray) -> None:
        need = math.ceil(num_tokens / ctx.block_size)
        if len(block_ids) < need:
            raise ChunkMismatchError(
                f"{len(block_ids)} block ids cannot hold {num_tokens} tokens "
                f"(block size {ctx.block_size}: need {need})"
            )

    @staticmethod
    def _block_ids(ctx: GPUCacheContext, block_ids: IntArray, n: int) -> np.ndarray:
        """The first ``n`` block ids as int64, range-checked before anything is reserved."""
        ids = np.asarray(block_ids[:n], dtype=np.int64)
        if ids.ndim != 1:
            raise BlockIdError(f"block_ids must be one-dimensional, got shape {ids.shape}")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= ctx.num_blocks):
            bad = int(np.flatnonzero((ids < 0) | (ids >= ctx.num_blocks))[0])
            raise BlockIdError(
                f"block id {int(ids[bad])} at position {bad} is outside [0, {ctx.num_blocks}); "
                "nothing was copied"
            )
        return ids


__all__ = ["CacheEngine", "StoreResult"]


def _engine_block_metadata(
    chunk_indices: list[int],
    bpc: int,
    block_size: int,
    chunk_size: int,
    block_hashes: Sequence[int],
    token_ids: IntArray,
) -> dict[str, Any] | None:
    """The ``L1_WRITE_FINISHED`` keys that let KV-event routers join the engine's own
    block hashes (EVENTS.md); None when the hashes do not cover the chunks."""
    if chunk_indices and len(block_hashes) < (max(chunk_indices) + 1) * bpc:
        return None
    hashes: list[int] = []
    parents: list[int | None] = []
    tokens: list[int] = []
    for i in chunk_indices:
        hashes.extend(int(h) for h in block_hashes[i * bpc : (i + 1) * bpc])
        parents.append(int(block_hashes[i * bpc - 1]) if i > 0 else None)
        tokens.extend(int(t) for t in token_ids[i * chunk_size : (i + 1) * chunk_size])
    return {
        "block_hashes": hashes,
        "block_size": block_size,
        "parent_block_hashes": parents,
        "token_ids": tokens,
    }
