"""Runs an ``L2Adapter`` off the caller's thread: bounded in-flight work, back-off, events.

Written once for every tier so adapters stay simple synchronous code. Three promises to the
engine: a lookup never waits on a slow tier and a store waits at most the bound it passes
(a healthy tier that is only busy gets that long for a place; past it, or when the tier is
down, the write is dropped and counted, and a down tier answers "miss" at once); every
completed operation is published as an ``L2_*`` event with its duration (a load with the
``ChunkIdentity`` its writer kept with the chunk, where the tier keeps one); and ``flush``
lets tests and ``close`` wait for what is queued.

Batching (group commit): queued work of one kind is handed to the adapter in batches of up
to ``adapter.max_batch`` chunks (``store_many``/``load_many``); a runner takes whatever is
queued when it starts, so a lone write goes at once and a burst (a prompt's chunks, written
through together) travels pipelined. At most ``workers`` runners per kind; after each batch a
runner re-queues itself behind the pool's other work, so writes and prefetches take turns.

Back-off: a ``timeout``/``unavailable`` failure marks the tier down for ``retry_interval_s``;
the first operation after that interval tries again (and re-arms the back-off if it fails).
A failure tagged ``scope="shard"`` (one Redis Cluster shard down) does not: the adapter fails
that shard's keys fast by itself while the other shards keep answering.

Logging: a failure is logged once per episode (per operation and reason, until an operation of
that kind succeeds); the repeats go to DEBUG. Every failure is still an event, so the metrics
count each one: a full disk or a dead server must not turn the log into one line per chunk.
Shard failures go to DEBUG only: the adapter logs each shard going down and coming back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from kvcache.errors import ChecksumMismatchError
from kvcache.observability.event import (
    Event,
    EventSink,
    EventType,
    L2ChecksumFailed,
    L2LoadFailed,
    L2LoadFinished,
    L2StoreFailed,
    L2StoreFinished,
    NullEventBus,
)
from kvcache.records import ChunkIdentity, ChunkKey
from kvcache.storage.admission import AdmissionPolicy, AlwaysAdmit
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import L2Adapter, failure_reason, failure_scope, storage_error

logger = logging.getLogger(__name__)
Done = Callable[[bool], None]
_BACKOFF_REASONS = ("timeout", "unavailable")


class _Job(NamedTuple):
    key: ChunkKey
    tensor: torch.Tensor
    done: Done
    meta: bytes = b""
    tenant: str = ""


class AsyncL2:
    """One tier's thread pool. ``done(ok)`` callbacks run on the I/O thread and must be quick."""

    def __init__(
        self,
        adapter: L2Adapter,
        *,
        workers: int = 4,
        max_inflight: int = 64,
        retry_interval_s: float = 5.0,
        bus: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.adapter = adapter
        self.admission: AdmissionPolicy = admission if admission is not None else AlwaysAdmit()
        """Which stored (or hit) chunks this tier takes (``kvcache.engine.admission`` asks it)."""
        self.backend = adapter.backend
        self.max_inflight = max_inflight
        self.retry_interval_s = retry_interval_s
        self._bus: EventSink = bus if bus is not None else NullEventBus()
        self._clock = clock
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvcache-l2-{self.backend}")
        self._cond = threading.Condition()
        self._inflight = {"store": 0, "load": 0}  # admitted and not yet done (queued + running)
        self._queues: dict[str, deque[_Job]] = {"store": deque(), "load": deque()}
        self._runners = {"store": 0, "load": 0}
        self._down_until = 0.0
        self._closed = False
        self._warned: set[tuple[str, str]] = set()  # (op, reason) episodes already logged
        self.counters = {
            "stores": 0,
            "store_failures": 0,
            "stores_dropped": 0,
            "loads": 0,
            "load_failures": 0,
            "load_misses": 0,
            "contains_failures": 0,
        }

    # -- state ----------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def _failed(self, exc: BaseException) -> None:
        if failure_reason(exc) in _BACKOFF_REASONS and failure_scope(exc) == "tier":
            self._down_until = self._clock() + self.retry_interval_s

    # -- operations -----------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence per key; an unavailable or failing tier answers all-miss (and is counted)."""
        if not keys:
            return []
        if not self.available or self._closed:
            return [False] * len(keys)
        try:
            results = self.adapter.contains_many(keys)
        except Exception as exc:  # an adapter that breaks the per-key promise fails every key
            results = [exc] * len(keys)
        found: list[bool] = []
        failed: dict[str, list[ChunkKey]] = {}
        errors: list[Exception] = []
        for key, res in zip(keys, self._checked(results, len(keys)), strict=True):
            if isinstance(res, Exception):
                failed.setdefault(failure_reason(res), []).append(key)
                errors.append(res)
            found.append(not isinstance(res, Exception) and bool(res))
        if not any(failure_scope(e) == "tier" for e in errors):
            self._succeeded("lookup")  # the tier answered (a shard may not have)
        if not errors:
            return found
        with self._cond:
            self.counters["contains_failures"] += 1
        for reason, failed_keys in failed.items():
            meta = L2LoadFailed(backend=self.backend, keys=failed_keys, reason=reason)
            self._bus.publish(Event(EventType.L2_LOAD_FAILED, meta))
        for err in errors:
            self._failed(err)
        first = errors[0]
        reason = failure_reason(first)
        self._log_failure(first, "lookup", "L2 %s lookup failed (%s): %s", self.backend, reason, first)
        return found

    def submit_store(
        self,
        key: ChunkKey,
        chunk: torch.Tensor,
        done: Done,
        wait_s: float = 0.0,
        meta: bytes = b"",
        tenant: str = "",
    ) -> bool:
        """Queue a write of ``chunk`` (which must stay valid until ``done`` runs), with ``meta``
        (see ``L2Adapter.store_many_with_meta``) for a tier that ``keeps_meta``, on behalf of
        ``tenant`` (whose share of a tier shared out between tenants it counts against).

        A healthy tier with ``max_inflight`` writes queued gets up to ``wait_s`` to make room
        (back-pressure rather than loss). Returns False, without calling ``done``, when the
        write was refused (tier down, or still full after ``wait_s``); the refusal is published
        as ``L2_STORE_FAILED``.
        """
        reason = self._admit("store", wait_s)
        if reason is not None:
            with self._cond:
                self.counters["stores_dropped"] += 1
            refused = L2StoreFailed(backend=self.backend, keys=[key], reason=reason)
            self._bus.publish(Event(EventType.L2_STORE_FAILED, refused))
            return False
        self._enqueue("store", _Job(key, chunk, done, meta, tenant))
        return True

    def submit_load(self, key: ChunkKey, out: torch.Tensor, done: Done, wait_s: float = 0.0) -> bool:
        """Queue a read into ``out``; ``done(True)`` only when ``out`` holds the verified chunk.

        Returns False, without calling ``done``, when the tier is down, or still too busy after
        ``wait_s`` (a lookup's prefetch does not wait; a retrieve waits within its bound).
        """
        if self._admit("load", wait_s) is not None:
            return False
        self._enqueue("load", _Job(key, out, done))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._inflight.values()), timeout)

    def info(self) -> dict[str, Any]:
        info = self.adapter.info()
        with self._cond:
            info.update(self.counters)
            info["inflight"] = dict(self._inflight)
        info["available"] = self.available
        info["admission"] = self.admission.name
        return info

    def close(self) -> None:
        """Drain queued work, stop the threads, close the adapter; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._pool.shutdown(wait=True)
        self.adapter.close()

    # -- internals ------------------------------------------------------------------------
    def _admit(self, op: str, wait_s: float = 0.0) -> str | None:
        if self._closed or not self.available:
            return "unavailable"
        with self._cond:
            if not self._cond.wait_for(lambda: self._inflight[op] < self.max_inflight, wait_s):
                return "busy"
            self._inflight[op] += 1
        return None

    def _succeeded(self, op: str) -> None:
        """End ``op``'s failure episodes: its next failure is news again."""
        if self._warned:  # read without the lock: the common case costs nothing
            with self._cond:
                self._warned = {w for w in self._warned if w[0] != op}

    def _log_failure(self, exc: BaseException, op: str, msg: str, *args: object) -> None:
        """WARNING for the first failure of an episode, DEBUG for its repeats and for shard
        failures (the adapter logs a shard's transitions itself)."""
        if failure_scope(exc) == "shard":
            logger.debug(msg, *args)
            return
        reason = failure_reason(exc)
        with self._cond:
            first = (op, reason) not in self._warned
            self._warned.add((op, reason))
        if first:
            logger.warning(msg + " (repeats are logged at DEBUG until a %s succeeds)", *args, op)
        else:
            logger.debug(msg, *args)

    def _enqueue(self, op: str, job: _Job) -> None:
        with self._cond:
            self._queues[op].append(job)
            start = self._runners[op] < self._workers
            if start:
                self._runners[op] += 1
        if start:
            self._spawn(op)

    def _spawn(self, op: str) -> None:
        try:
            self._pool.submit(self._drain, op)
        except RuntimeError:  # the pool shut down under a racing submit: drain right here
            self._drain(op, requeue=False)

    def _take(self, op: str) -> list[_Job]:
        """The next batch of ``op`` (caller holds the lock): up to ``max_batch`` jobs and
        ``max_batch_bytes``, at least one job."""
        queue = self._queues[op]
        jobs: list[_Job] = []
        nbytes = 0
        limit, byte_limit = max(1, self.adapter.max_batch), self.adapter.max_batch_bytes
        while queue and len(jobs) < limit:
            size = queue[0].tensor.numel() * queue[0].tensor.element_size()
            if jobs and nbytes + size > byte_limit:
                break
            jobs.append(queue.popleft())
            nbytes += size
        return jobs

    def _drain(self, op: str, requeue: bool = True) -> None:
        """One runner: run a batch, then go to the back of the pool's queue if work is left
        (``requeue``) or keep going here; exits when the queue is empty."""
        while True:
            with self._cond:
                jobs = self._take(op)
                if not jobs:
                    self._runners[op] -= 1
                    return
            self._run_batch(op, jobs)
            if requeue:
                with self._cond:
                    if not self._queues[op]:
                        self._runners[op] -= 1
                        return
                self._spawn(op)
                return

    def _run_batch(self, op: str, jobs: list[_Job]) -> None:
        """Run one batch through the adapter; publish, count and complete every job."""
        mark = [time.perf_counter()]

        def lap() -> float:
            # Seconds since the previous completion in this batch: the events of a pipelined
            # batch then add up to its wall time instead of each claiming all of it.
            now = time.perf_counter()
            elapsed, mark[0] = now - mark[0], now
            return elapsed

        metas = [j.meta for j in jobs]
        try:
            if op == "store":
                items = [(j.key, j.tensor, self._announcer(j.key, lap)) for j in jobs]
                tenants = [j.tenant for j in jobs]
                with_meta = any(metas) or any(tenants)
                stored = self.adapter.store_many_with_meta(items, metas, tenants) if with_meta else None
                results: list[Any] = list(stored if stored is not None else self.adapter.store_many(items))
            else:
                loaded, metas = self.adapter.load_many_with_meta([(j.key, j.tensor) for j in jobs])
                results = list(loaded)
        except Exception as exc:  # an adapter that breaks the per-item promise fails them all
            results = [exc] * len(jobs)
        if len(metas) != len(jobs):
            metas = [b""] * len(jobs)
        any_ok = False
        for job, res, kept in zip(jobs, self._checked(results, len(jobs)), metas, strict=True):
            ok = False
            try:
                if isinstance(res, Exception):
                    self._job_failed(op, job.key, res)
                elif op == "store":
                    ok = any_ok = True
                    with self._cond:
                        self.counters["stores"] += 1
                else:
                    ok, any_ok = bool(res), True  # a miss is an answer too
                    with self._cond:
                        self.counters["loads" if ok else "load_misses"] += 1
                    if ok:
                        identity = self._identity(kept)
                        meta = L2LoadFinished(
                            backend=self.backend,
                            keys=[job.key],
                            num_bytes=job.tensor.numel() * job.tensor.element_size(),
                            duration_s=lap(),
                            identities=[identity] if identity is not None else [],
                        )
                        self._bus.publish(Event(EventType.L2_LOAD_FINISHED, meta))
            finally:
                self._complete(op, job, ok)
        if any_ok:
            self._succeeded(op)

    def _identity(self, meta: bytes) -> ChunkIdentity | None:
        """How a loaded chunk's writer announced it, decoded only for a real sink."""
        return None if isinstance(self._bus, NullEventBus) else codec.chunk_identity(meta)

    def _announcer(self, key: ChunkKey, lap: Callable[[], float]) -> Callable[[int], None]:
        def announce(nbytes: int) -> None:
            # Called by the adapter at the moment the chunk became visible (under its lock),
            # so this event is ordered before any eviction of the key.
            meta = L2StoreFinished(backend=self.backend, keys=[key], num_bytes=nbytes, duration_s=lap())
            self._bus.publish(Event(EventType.L2_STORE_FINISHED, meta))

        return announce

    def _checked(self, results: Sequence[Any], n: int) -> Sequence[Any]:
        if len(results) == n:
            return results
        err = storage_error(f"L2 {self.backend} answered {len(results)} results for {n} items", "io")
        return [err] * n

    def _job_failed(self, op: str, key: ChunkKey, exc: Exception) -> None:
        reason = failure_reason(exc)
        self._failed(exc)
        with self._cond:
            self.counters[f"{op}_failures"] += 1
        if op == "store":
            stored = L2StoreFailed(backend=self.backend, keys=[key], reason=reason)
            self._bus.publish(Event(EventType.L2_STORE_FAILED, stored))
        else:
            loaded = L2LoadFailed(backend=self.backend, keys=[key], reason=reason)
            self._bus.publish(Event(EventType.L2_LOAD_FAILED, loaded))
            if isinstance(exc, ChecksumMismatchError):  # also its own series: never served
                bad = L2ChecksumFailed(backend=self.backend, keys=[key], detail=str(exc))
                self._bus.publish(Event(EventType.L2_CHECKSUM_FAILED, bad))
        self._log_failure(exc, op, "L2 %s %s of %032x failed (%s): %s", self.backend, op, key, reason, exc)

    def _complete(self, op: str, job: _Job, ok: bool) -> None:
        try:
            job.done(ok)
        except Exception:  # a broken callback must not leak the in-flight slot
            logger.exception("L2 %s completion callback failed", self.backend)
        with self._cond:
            self._inflight[op] -= 1
            self._cond.notify_all()


__all__ = ["AsyncL2"]
