"""CacheEngine: the in-process library API — register, lookup, store, retrieve — over L1 + L2.

The one place that ties keys, the L1 pool, the L2 tiers and the transfer contexts together;
everything it does is published on the event sink it was given (``NullEventBus`` by default,
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
* **One request value, one entry per direction:** ``submit_store`` / ``submit_retrieve`` take
  a request checked when it was built (``kvcache.request``), submit the copies and return a
  future of the direction's result record (``kvcache.records``); each instance's copies are
  completed on its own completer thread, in submission order. Neither waits on its caller's
  thread: a store short of L1 room waits on the engine's store waiter, a retrieve of chunks
  still loading from L2 on its retrieve waiter (``waiter``), each in arrival order. A stored
  chunk becomes visible to lookups only when its copy finished. ``store_async`` /
  ``retrieve_async`` build the request from arguments; ``store`` / ``retrieve`` wait too.
* **Concurrency:** the L1 lock covers bookkeeping only; copies run unlocked on pinned slots.
* **Statistics** (bytes, seconds, sizes of copies) come from the copies' ``TransferResult``
  records only (``records.CopyTally``), for ``stats_snapshot`` and the MP_*_END events alike.

This module is the facade (registration, lifecycle, introspection); the paths live in
``store``, ``lookup`` and ``retrieve`` (their waits in ``waiter``), completion of copies in
``completion``, report checks in ``reports`` and the MP_* event metadata in ``op_events``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvcache.config import EngineConfig
from kvcache.context import CacheContext
from kvcache.deadline import Deadline
from kvcache.engine import lookup as lookup_path
from kvcache.engine import pages as pages_path
from kvcache.engine import retrieve as retrieve_path
from kvcache.engine import store as store_path
from kvcache.engine.admission import HitPromoter
from kvcache.engine.instance import InstanceState
from kvcache.engine.lookup import LookupHit
from kvcache.engine.op_events import OpEvents
from kvcache.engine.parts import EngineParts
from kvcache.engine.reports import publish_allocations, publish_end_session
from kvcache.engine.stats import OffloadStats, OffloadStatsCollector
from kvcache.errors import LayoutError, UnknownInstanceError
from kvcache.futures import failed
from kvcache.geometry import Geometry
from kvcache.ids import Packed, RawIds
from kvcache.keys import KeyScope
from kvcache.layouts import KVCaches, KVFormat
from kvcache.observability.event import Event, EventSink, EventType, InstanceUnregistered, NullEventBus
from kvcache.records import BlockAllocationRecord, RetrieveResult, StoreResult
from kvcache.request import RetrieveRequest, StoreRequest
from kvcache.storage.l1.pool import L1Pool
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.factory import admission_for, create_policy, l2_adapters_from_config
from kvcache.transfer.base import CopyPriority

_T = TypeVar("_T")


class CacheEngine:
    """Offloads registered engine KV caches to L1 (CPU) and L2 (disk, Redis). Thread-safe."""

    def __init__(self, config: EngineConfig, bus: EventSink | None = None) -> None:
        self.config = config
        self._bus: EventSink = bus if bus is not None else NullEventBus()
        self._pool = L1Pool(
            config.l1_size_bytes,
            watermark=config.l1_evict_watermark,
            extent_bytes=config.l1_extent_bytes,
            pin_memory=config.l1_pin_memory,
            policy=functools.partial(create_policy, config.l1_eviction),  # one per tenant
            bus=self._bus,
        )
        self._tiers = [
            AsyncL2(
                adapter,
                workers=config.l2_workers,
                max_inflight=config.l2_max_inflight,
                retry_interval_s=config.l2_retry_interval_s,
                bus=self._bus,
                admission=admission_for(config, adapter.backend),
            )
            for adapter in l2_adapters_from_config(config, self._bus)
        ]
        promoter = HitPromoter(self._pool, self._tiers)
        if promoter.active:  # a tier writes chunks on a hit: the pool tells it of reads
            self._pool.watch_reads(promoter)
        self._stats = OffloadStatsCollector()
        self._instances: dict[int, InstanceState] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._parts = EngineParts.build(config, self._pool, self._tiers, self._stats, OpEvents(self._bus))
        self._waiters = (self._parts.store_waiter, self._parts.retrieve_waiter)
        self.pages = pages_path.EnginePages(self._parts, self._instance)
        """Pages keyed by the serving engine (SGLang HiCache), over the same tiers."""

    # -- registration ---------------------------------------------------------------------
    def register(
        self,
        instance_id: int,
        model_name: str,
        kv_caches: KVCaches,
        *,
        engine: str = "vllm",
        fmt: KVFormat | None = None,
        block_size: int | None = None,
        chunk_size: int | None = None,
        replace: bool = False,
        tenant: str = "",
        priority: CopyPriority | None = None,
    ) -> CacheContext:
        """Register an engine's KV tensors; the chunk size comes from the config unless
        ``chunk_size`` (at most the config's) asks for smaller chunks: SGLang page instances
        (``pages``) keep one page per chunk. ``replace``: an instance of that id is
        unregistered first, once the new registration passed every check (a refused one
        changes nothing). ``tenant``: whose share of L1 and of the disk tier its chunks count
        against; room is taken from the tenant holding the most (``storage.shares``), so give
        each party sharing the engine a name of its own (the daemon names its principals).
        ``priority``: whether its CPU copies give way to others' (``transfer.base.CopyPriority``;
        the daemon: the principal's ``server.copy_share``)."""
        if chunk_size is not None and not 0 < chunk_size <= self.config.chunk_size:
            raise LayoutError(f"chunk_size must be in [1, {self.config.chunk_size}], got {chunk_size}")
        cs = chunk_size or self.config.chunk_size
        ctx = CacheContext(
            kv_caches, chunk_size=cs, fmt=fmt, engine=engine, block_size=block_size, priority=priority
        )
        if replace and instance_id in self._instances:
            self.unregister(instance_id)
        with self._lock:
            if instance_id in self._instances:
                raise LayoutError(f"instance {instance_id} is already registered; unregister it first")
            self._instances[instance_id] = InstanceState(instance_id, model_name, ctx, tenant)
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
        inst.leave()
        for waiter in self._waiters:
            waiter.cancel(instance_id)
        inst.completer.close()
        meta = InstanceUnregistered(instance_id=instance_id, model_name=inst.model_name)
        self._bus.publish(Event(EventType.INSTANCE_UNREGISTERED, meta))

    def _instance(self, instance_id: int) -> InstanceState:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstanceError(f"instance {instance_id} is not registered") from None

    # -- data path (store.py, retrieve.py) ----------------------------------------------------
    def geometry(self, instance_id: int) -> Geometry:
        """What a request for ``instance_id`` is checked against when it is built
        (``StoreRequest.build`` / ``RetrieveRequest.build``)."""
        return self._instance(instance_id).ctx.geometry

    def lookup(
        self,
        instance_id: int,
        token_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_scope: KeyScope | None = None,
    ) -> int:
        """Tokens of the longest cached prefix (whole chunks); starts L2 -> L1 prefetch of it.
        ``key_scope``: whose chunks; a bare ``cache_salt`` is ``KeyScope(cache_salt)``."""
        hit = self.lookup_tiers(
            instance_id, token_ids, cache_salt=cache_salt, request_id=request_id, key_scope=key_scope
        )
        return hit.hit_tokens

    def lookup_tiers(
        self,
        instance_id: int,
        token_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_scope: KeyScope | None = None,
    ) -> LookupHit:
        """``lookup``, also saying how much of the prefix comes from L2."""
        inst = self._instance(instance_id)
        scope = key_scope if key_scope is not None else KeyScope(cache_salt)
        return lookup_path.lookup(self._parts, inst, token_ids, key_scope=scope, request_id=request_id)

    def lookup_many(
        self, instance_id: int, queries: Sequence[tuple[RawIds | Packed, KeyScope, str]]
    ) -> list[LookupHit]:
        """``lookup_tiers`` of each ``(token_ids, key_scope, request_id)``, in order (one
        scheduler step's requests); prompts sharing a head with the one before hash it once.
        Ids may stay packed (``ids.Packed``, checked by ``ids.checked_packed``)."""
        return lookup_path.lookup_many(self._parts, self._instance(instance_id), queries)

    def submit_store(self, req: StoreRequest) -> Future[StoreResult]:
        """Start a store: reserve the slots, submit the copies and return (``.result()`` waits).

        The future resolves after the chunks became visible to lookups (each only once its
        copy finished) and ``MP_STORE_END`` was published; errors (a failed copy, the
        request's deadline passed) are set on it, with the failed chunks' slots freed. Chunks
        already cached are skipped. When L1 is held by chunks still being written through,
        the store waits for room (``store_wait_timeout_s`` in all, on the engine's store
        waiter, never on the caller's thread); what still does not fit is reported in
        ``failed_chunks`` (a trailing run: the leading chunks are stored). While an instance
        has a store waiting there, its later stores queue behind it, in call order.

        NOTE: the engine's ``block_ids`` must keep their KV until the future resolves: a store
        that waited copies after later operations that did not (a retrieve into its blocks).
        """
        try:
            inst = self._instance(req.instance_id)
        except UnknownInstanceError as err:
            return failed(err)
        return store_path.store_async(self._parts, inst, req)

    def submit_retrieve(self, req: RetrieveRequest) -> Future[RetrieveResult]:
        """Start a retrieve: the future resolves (after ``MP_RETRIEVE_END``) once the blocks
        hold the cached prefix, with its length (skip + copied) and what the copies moved;
        errors are set on it. Chunks still loading from L2 are waited for, within
        ``retrieve_wait_timeout_s`` and the request's deadline, on the engine's retrieve
        waiter (behind no store); the prefix ends at the first one not READY then. Past the
        deadline nothing is written into the blocks (``DeadlineExceededError``). The engine
        must not read ``block_ids`` before the future resolved."""
        try:
            inst = self._instance(req.instance_id)
        except UnknownInstanceError as err:
            return failed(err)
        return retrieve_path.retrieve_async(self._parts, inst, req)

    # Argument-list forms: build the request.
    def store_async(
        self,
        instance_id: int,
        token_ids: RawIds,
        block_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        deadline: Deadline | None = None,
        after: Any = None,
    ) -> Future[StoreResult]:
        """``submit_store`` of ``StoreRequest.build(...)``; never raises."""
        try:
            req = StoreRequest.build(
                instance_id, self.geometry(instance_id), token_ids, block_ids,
                scope=KeyScope(cache_salt), request_id=request_id, deadline=deadline,
                after=after, block_hashes=block_hashes,
            )  # fmt: skip
        except Exception as err:  # a bad request: nothing was reserved or published
            return failed(err)
        return self.submit_store(req)

    def store(
        self,
        instance_id: int,
        token_ids: RawIds,
        block_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        deadline: Deadline | None = None,
        after: Any = None,
    ) -> StoreResult:
        """A wait on ``store_async``; raises what its future holds."""
        future = self.store_async(
            instance_id, token_ids, block_ids, cache_salt=cache_salt, request_id=request_id,
            block_hashes=block_hashes, deadline=deadline, after=after,
        )  # fmt: skip
        return self._wait(instance_id, future)

    def retrieve_async(
        self,
        instance_id: int,
        token_ids: RawIds,
        block_ids: RawIds,
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        deadline: Deadline | None = None,
    ) -> Future[RetrieveResult]:
        """``submit_retrieve`` of ``RetrieveRequest.build(...)``; never raises."""
        try:
            req = RetrieveRequest.build(
                instance_id, self.geometry(instance_id), token_ids, block_ids, skip_tokens,
                scope=KeyScope(cache_salt), request_id=request_id, deadline=deadline,
            )  # fmt: skip
        except Exception as err:  # a bad request: nothing was pinned or published
            return failed(err)
        return self.submit_retrieve(req)

    def retrieve(
        self,
        instance_id: int,
        token_ids: RawIds,
        block_ids: RawIds,
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        deadline: Deadline | None = None,
    ) -> int:
        """A wait on ``retrieve_async``: the prefix length now valid in the engine (skip +
        copied); raises what its future holds."""
        future = self.retrieve_async(
            instance_id, token_ids, block_ids, skip_tokens,
            cache_salt=cache_salt, request_id=request_id, deadline=deadline,
        )  # fmt: skip
        return self._wait(instance_id, future).retrieved_tokens

    def _wait(self, instance_id: int, future: Future[_T]) -> _T:
        """``future.result()``, refused on the instance's completer thread, a waiter's or the
        alarms' (a done-callback calling ``store``), where it would wait for work queued
        behind itself."""
        inst = self._instances.get(instance_id)
        own = any(w.on_own_thread() for w in self._waiters) or self._parts.alarms.on_own_thread()
        own = own or (inst is not None and inst.completer.on_own_thread())
        if own and not future.done():
            raise RuntimeError(
                "store/retrieve called from a done-callback of an engine future would wait for "
                "itself; use store_async/retrieve_async there"
            )
        return future.result()

    # -- engine bookkeeping events ----------------------------------------------------------
    def report_block_allocations(self, instance_id: int, records: list[BlockAllocationRecord]) -> None:
        """Publish block allocations for lifecycle tracking, checked whole first (``reports``)."""
        inst = self._instance(instance_id)
        publish_allocations(self._bus, inst, self.config.max_report_records, records)

    def end_session(self, instance_id: int, request_id: str) -> None:
        publish_end_session(self._bus, self._instance(instance_id), request_id)

    # -- introspection --------------------------------------------------------------------
    def stats_snapshot(self) -> OffloadStats:
        """Offload activity since the previous call (snapshot-and-reset)."""
        return self._stats.snapshot()

    def status(self) -> dict[str, Any]:
        instances = [inst.info() for inst in list(self._instances.values())]
        l1, l2 = self._pool.info(), [tier.info() for tier in self._tiers]
        return {"chunk_size": self.config.chunk_size, "instances": instances, "l1": l1, "l2": l2}

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
        for inst in list(self._instances.values()):  # no store copies from a callback from now on
            inst.leave()
        for waiter in self._waiters:
            waiter.close()
        for inst in list(self._instances.values()):
            inst.completer.close()
        for tier in self._tiers:
            tier.close()
        self._parts.alarms.close()  # a store still watching a load (none after the tiers) ends

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CacheEngine", "LookupHit", "RetrieveResult", "StoreResult"]
