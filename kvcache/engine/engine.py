"""CacheEngine: the in-process library API — register, lookup, store, retrieve — over L1 + L2.

The one place that ties keys, the L1 pool, the L2 tiers and the transfer contexts together;
everything it does is published on the event sink it was given (``NullEventSink`` by default,
so the engine behaves the same with observability off).

Policies, stated once:

* **Only full chunks** are stored and looked up; a trailing partial chunk is ignored.
* **Write-through:** every chunk newly written to L1 is also queued to every L2 tier; the L1
  slot stays pinned until each write finishes. A tier that is down drops the write at once
  (counted); a healthy but busy one, or an L1 held by such writes, slows the store down for at
  most ``store_wait_timeout_s``, after which the chunk is dropped, reported and counted.
* **Lookup** counts the prefix of chunks in L1 or present in L2 (disk first, then Redis), and
  starts loading the L2 ones into L1 (prefetch) before it returns; ``retrieve`` waits for those
  loads. The first missing chunk ends the prefix.
* **Asynchronous copies:** ``store_async`` / ``retrieve_async`` submit the copies and return a
  future; each instance's copies are completed on its own completer thread, in submission
  order. Neither waits on its caller's thread: a store short of L1 room waits on the engine's
  store waiter, a retrieve of chunks still loading from L2 on its retrieve waiter (``waiter``),
  each in arrival order. A stored chunk
  becomes visible to lookups only when its copy finished; ``store`` and ``retrieve`` are waits
  on the futures.
* **Concurrency:** the L1 lock covers bookkeeping only; copies run unlocked on pinned slots, so a
  lookup never waits behind another thread's copy.
* **Statistics** (bytes, seconds, sizes of copies) come from the copies' ``TransferResult``
  records only (``records.CopyTally``), for ``stats_snapshot`` and the MP_*_END events alike.

This module is the facade (registration, lifecycle, introspection); the store path lives in
``store``, lookup/prefetch/retrieve in ``load`` (their waits in ``waiter``),
completion of copies in ``completion``, request checks in ``ids`` and ``reports``, result
records in ``records`` and the MP_* event metadata in ``op_events``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvcache.config import EngineConfig
from kvcache.context import GPUCacheContext
from kvcache.engine import load as load_path
from kvcache.engine import store as store_path
from kvcache.engine.ids import IntArray
from kvcache.engine.instance import Instance
from kvcache.engine.load import LookupHit
from kvcache.engine.op_events import OpEvents
from kvcache.engine.parts import EngineParts
from kvcache.engine.records import RetrieveResult, StoreResult
from kvcache.engine.reports import check_allocation_report
from kvcache.engine.stats import OffloadStats, OffloadStatsCollector
from kvcache.engine.waiter import Waiter
from kvcache.engine.waiting import WaitingRetrieves
from kvcache.errors import LayoutError, UnknownInstanceError
from kvcache.layouts import GPUKVFormat, KVCaches
from kvcache.observability.event import (
    Event,
    EventSink,
    EventType,
    InstanceUnregistered,
    MpVllmBlockAllocation,
    MpVllmEndSession,
    NullEventSink,
)
from kvcache.records import BlockAllocationRecord
from kvcache.storage.l1.pool import L1Pool
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.factory import create_policy, l2_adapters_from_config

_T = TypeVar("_T")


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
        self._closed = False
        settled = threading.Condition()  # EngineParts.loads_settled
        self._waiters = (
            Waiter(self._pool.wake_writers, "kvcache-store-wait"),
            Waiter(functools.partial(load_path.notify_settled, settled), "kvcache-retrieve-wait"),
        )
        shared = (self._pool, self._tiers, self._stats, OpEvents(self._bus))
        waiting = WaitingRetrieves(settled)
        self._parts = EngineParts(config, *shared, *self._waiters, settled, waiting)

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
        """Forget an instance once its copies in flight completed; subscribers holding
        per-instance state drop it on the event. Its stores waiting for L1 room stop waiting
        (each takes what is free, the rest fails), and its retrieves waiting for L2 loads copy
        the READY prefix, before that."""
        with self._lock:
            inst = self._instances.pop(instance_id, None)
        if inst is None:
            raise UnknownInstanceError(f"instance {instance_id} is not registered")
        for waiter in self._waiters:
            waiter.cancel(instance_id)
        inst.completer.close()
        meta = InstanceUnregistered(instance_id=instance_id, model_name=inst.model_name)
        self._bus.publish(Event(EventType.INSTANCE_UNREGISTERED, meta))

    def _instance(self, instance_id: int) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstanceError(f"instance {instance_id} is not registered") from None

    # -- data path (store.py, load.py) --------------------------------------------------------
    def lookup(
        self, instance_id: int, token_ids: IntArray, *, cache_salt: str = "", request_id: str = ""
    ) -> int:
        """Tokens of the longest cached prefix (whole chunks); starts L2 -> L1 prefetch of it."""
        hit = self.lookup_tiers(instance_id, token_ids, cache_salt=cache_salt, request_id=request_id)
        return hit.hit_tokens

    def lookup_tiers(
        self, instance_id: int, token_ids: IntArray, *, cache_salt: str = "", request_id: str = ""
    ) -> LookupHit:
        """``lookup``, also saying how much of the prefix comes from L2."""
        inst = self._instance(instance_id)
        return load_path.lookup(self._parts, inst, token_ids, cache_salt=cache_salt, request_id=request_id)

    def lookup_many(
        self, instance_id: int, queries: Sequence[tuple[IntArray, str, str]]
    ) -> list[LookupHit]:
        """``lookup_tiers`` of each ``(token_ids, cache_salt, request_id)``, in order (one
        scheduler step's requests); prompts sharing a head with the one before hash it once."""
        inst = self._instance(instance_id)
        return load_path.lookup_many(self._parts, inst, queries)

    def store(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        copy_by: float | None = None,
        after: Any = None,
    ) -> StoreResult:
        """Copy the full chunks of ``token_ids`` (held in ``block_ids``) into the cache.

        Chunks already cached are skipped. When L1 is held by chunks still being written
        through, the store waits for room (``store_wait_timeout_s`` in all); what still does not
        fit is reported in ``failed_chunks`` (a trailing run: the leading chunks are stored).
        ``block_hashes`` (the engine's own per-block hashes) are passed through on the end
        event for KV-event publishers. ``copy_by`` (``time.monotonic()`` scale): when the caller
        stops waiting; no copy of its blocks starts later (``DeadlineExceededError``), since
        the engine may have reused them, and no wait lasts beyond it. ``after``: a CUDA event
        the engine recorded after writing the blocks (on a stream of its own); the copies wait
        for it on the device (``TransferJob.after``), and a CPU cache refuses it.

        A wait on ``store_async``; raises what its future holds.
        """
        future = self.store_async(
            instance_id,
            token_ids,
            block_ids,
            cache_salt=cache_salt,
            request_id=request_id,
            block_hashes=block_hashes,
            copy_by=copy_by,
            after=after,
        )
        return self._wait(instance_id, future)

    def store_async(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        copy_by: float | None = None,
        after: Any = None,
    ) -> Future[StoreResult]:
        """``store`` without waiting for the copies: reserves the slots, submits the copies and
        returns. The future resolves after the chunks became visible to lookups (each only once
        its copy finished) and ``MP_STORE_END`` was published; errors (a bad request, a failed
        copy, ``copy_by`` passed) are set on it, with the failed chunks' slots freed.

        It never waits for L1 room on the caller's thread: short of room, it submits what fits
        and hands the rest to the engine's waiter thread (bounded as ``store`` says); while an
        instance has a store waiting there, its later stores queue behind it, in call order.

        NOTE: the engine's ``block_ids`` must keep their KV until the future resolves: a store
        that waited copies after later operations that did not (a retrieve into its blocks).
        """
        try:
            inst = self._instance(instance_id)
        except UnknownInstanceError as err:
            return _failed(err)
        return store_path.store_async(
            self._parts,
            inst,
            token_ids,
            block_ids,
            cache_salt=cache_salt,
            request_id=request_id,
            block_hashes=block_hashes,
            copy_by=copy_by,
            after=after,
        )

    def retrieve(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        copy_by: float | None = None,
    ) -> int:
        """Copy the cached prefix of ``token_ids`` into ``block_ids``, leaving the first
        ``skip_tokens`` (rounded down to whole blocks) alone; returns the prefix length now
        valid in the engine (skip + copied). Chunks still loading from L2 are waited for,
        within ``retrieve_wait_timeout_s``; the prefix ends at the first one not READY then.
        ``copy_by``: as for ``store``; waits for L2 loads end there, and past it nothing is
        written into ``block_ids`` (``DeadlineExceededError``).

        A wait on ``retrieve_async``; raises what its future holds."""
        future = self.retrieve_async(
            instance_id,
            token_ids,
            block_ids,
            skip_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
            copy_by=copy_by,
        )
        return self._wait(instance_id, future).retrieved_tokens

    def _wait(self, instance_id: int, future: Future[_T]) -> _T:
        """``future.result()``, refused on the instance's completer thread or a waiter's (a
        done-callback calling ``store``), where it would wait for work queued behind itself."""
        inst = self._instances.get(instance_id)
        own = any(w.on_own_thread() for w in self._waiters)
        own = own or (inst is not None and inst.completer.on_own_thread())
        if own and not future.done():
            raise RuntimeError(
                "store/retrieve called from a done-callback of an engine future would wait for "
                "itself; use store_async/retrieve_async there"
            )
        return future.result()

    def retrieve_async(
        self,
        instance_id: int,
        token_ids: IntArray,
        block_ids: IntArray,
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        copy_by: float | None = None,
    ) -> Future[RetrieveResult]:
        """``retrieve`` without waiting: the future resolves (after ``MP_RETRIEVE_END``) once
        the blocks hold the prefix, with the prefix length and what the copies moved
        (``RetrieveResult``); errors are set on it.

        It never waits on the caller's thread: it copies the READY prefix, or, when chunks
        of it are still loading from L2 (or L2 may hold more), hands the retrieve to the
        engine's retrieve waiter, behind no store (see ``waiter``), which waits as ``retrieve``
        says. The engine must not read ``block_ids`` before the future resolved.
        """
        try:
            inst = self._instance(instance_id)
        except UnknownInstanceError as err:
            return _failed(err)
        return load_path.retrieve_async(
            self._parts,
            inst,
            token_ids,
            block_ids,
            skip_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
            copy_by=copy_by,
        )

    # -- engine bookkeeping events ----------------------------------------------------------
    def report_block_allocations(self, instance_id: int, records: list[BlockAllocationRecord]) -> None:
        """Publish the engine's block allocations for lifecycle tracking.

        The whole report is checked before anything is published, and one bad part refuses it
        all: a block id outside the registered cache (``BlockIdError``), more records than
        ``max_report_records`` or a record with more new blocks than the cache has
        (``LimitExceededError``). Subscribers keep state per (instance, block) and per record,
        which stays bounded only if these are."""
        inst = self._instance(instance_id)
        check_allocation_report(instance_id, inst.ctx.num_blocks, self.config.max_report_records, records)
        meta = MpVllmBlockAllocation(
            instance_id=instance_id,
            model_name=inst.model_name,
            records=list(records),
            block_size=inst.ctx.block_size,  # lets L0 lifecycle tell the blocks of a record apart
        )
        self._bus.publish(Event(EventType.MP_VLLM_BLOCK_ALLOCATION, meta))

    def end_session(self, instance_id: int, request_id: str) -> None:
        inst = self._instance(instance_id)
        meta = MpVllmEndSession(instance_id=instance_id, model_name=inst.model_name, request_id=request_id)
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
        """Complete the stores and retrieves in flight (their futures resolve), then finish
        pending L2 writes and close the tiers; idempotent. Waiting operations stop waiting
        first: a store takes what is free, the rest fails (``failed_chunks``); a retrieve
        copies the READY prefix."""
        if self._closed:
            return
        self._closed = True
        for waiter in self._waiters:
            waiter.close()
        for inst in list(self._instances.values()):
            inst.completer.close()
        for tier in self._tiers:
            tier.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failed(err: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(err)
    return future


__all__ = ["CacheEngine", "LookupHit", "RetrieveResult", "StoreResult"]
