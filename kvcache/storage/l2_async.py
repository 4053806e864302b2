"""Runs an ``L2Adapter`` off the caller's thread: bounded in-flight work, back-off, events.

Written once for every tier so adapters stay simple synchronous code. Three promises to the
engine: a lookup never waits on a slow tier and a store waits at most the bound it passes
(a healthy tier that is only busy gets that long for a place; past it, or when the tier is
down, the write is dropped and counted, and a down tier answers "miss" at once); every
completed operation is published as an ``L2_*`` event with its duration; and ``flush`` lets
tests and ``close`` wait for what is queued.

Back-off: a ``timeout``/``unavailable`` failure marks the tier down for ``retry_interval_s``;
the first operation after that interval tries again (and re-arms the back-off if it fails).

Logging: a failure is logged once per episode (per operation and reason, until an operation of
that kind succeeds); the repeats go to DEBUG. Every failure is still an event, so the metrics
count each one: a full disk or a dead server must not turn the log into one line per chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvcache.observability.event import ChunkKey, Event, EventSink, EventType, NullEventSink
from kvcache.storage.base import L2Adapter, failure_reason

logger = logging.getLogger(__name__)
Done = Callable[[bool], None]
_BACKOFF_REASONS = ("timeout", "unavailable")


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
    ) -> None:
        self.adapter = adapter
        self.backend = adapter.backend
        self.max_inflight = max_inflight
        self.retry_interval_s = retry_interval_s
        self._bus: EventSink = bus if bus is not None else NullEventSink()
        self._clock = clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvcache-l2-{self.backend}")
        self._cond = threading.Condition()
        self._inflight = {"store": 0, "load": 0}
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

    def _failed(self, reason: str) -> None:
        if reason in _BACKOFF_REASONS:
            self._down_until = self._clock() + self.retry_interval_s

    # -- operations -----------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence per key; an unavailable or failing tier answers all-miss (and is counted)."""
        if not keys:
            return []
        if not self.available or self._closed:
            return [False] * len(keys)
        try:
            found = self.adapter.contains(keys)
        except Exception as exc:
            reason = failure_reason(exc)
            self._failed(reason)
            with self._cond:
                self.counters["contains_failures"] += 1
            self._bus.publish(
                Event(
                    EventType.L2_LOAD_FAILED, {"backend": self.backend, "keys": list(keys), "reason": reason}
                )
            )
            self._log_failure("lookup", reason, "L2 %s lookup failed (%s): %s", self.backend, reason, exc)
            return [False] * len(keys)
        self._succeeded("lookup")
        return found

    def submit_store(self, key: ChunkKey, chunk: torch.Tensor, done: Done, wait_s: float = 0.0) -> bool:
        """Queue a write of ``chunk`` (which must stay valid until ``done`` runs).

        A healthy tier with ``max_inflight`` writes queued gets up to ``wait_s`` to make room
        (back-pressure rather than loss). Returns False, without calling ``done``, when the
        write was refused (tier down, or still full after ``wait_s``); the refusal is published
        as ``L2_STORE_FAILED``.
        """
        reason = self._admit("store", wait_s)
        if reason is not None:
            with self._cond:
                self.counters["stores_dropped"] += 1
            self._bus.publish(
                Event(EventType.L2_STORE_FAILED, {"backend": self.backend, "keys": [key], "reason": reason})
            )
            return False
        self._pool.submit(self._run, "store", key, chunk, done)
        return True

    def submit_load(self, key: ChunkKey, out: torch.Tensor, done: Done, wait_s: float = 0.0) -> bool:
        """Queue a read into ``out``; ``done(True)`` only when ``out`` holds the verified chunk.

        Returns False, without calling ``done``, when the tier is down, or still too busy after
        ``wait_s`` (a lookup's prefetch does not wait; a retrieve waits within its bound).
        """
        if self._admit("load", wait_s) is not None:
            return False
        self._pool.submit(self._run, "load", key, out, done)
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

    def _log_failure(self, op: str, reason: str, msg: str, *args: object) -> None:
        """WARNING for the first failure of an episode, DEBUG for its repeats."""
        with self._cond:
            first = (op, reason) not in self._warned
            self._warned.add((op, reason))
        if first:
            logger.warning(msg + " (repeats are logged at DEBUG until a %s succeeds)", *args, op)
        else:
            logger.debug(msg, *args)

    def _run(self, op: str, key: ChunkKey, tensor: torch.Tensor, done: Done) -> None:
        ok = False
        t0 = time.perf_counter()
        try:
            if op == "store":

                def announce(nbytes: int) -> None:
                    # Called by the adapter at the moment the chunk became visible (under
                    # its lock), so this event is ordered before any eviction of the key.
                    meta = {
                        "backend": self.backend,
                        "keys": [key],
                        "num_bytes": nbytes,
                        "duration_s": time.perf_counter() - t0,
                    }
                    self._bus.publish(Event(EventType.L2_STORE_FINISHED, meta))

                self.adapter.store(key, tensor, announce)
                ok = True
                with self._cond:
                    self.counters["stores"] += 1
                self._succeeded(op)
            else:
                ok = self.adapter.load(key, tensor)
                with self._cond:
                    self.counters["loads" if ok else "load_misses"] += 1
                self._succeeded(op)  # a miss is an answer too
                if ok:
                    meta = {
                        "backend": self.backend,
                        "keys": [key],
                        "num_bytes": tensor.numel() * tensor.element_size(),
                        "duration_s": time.perf_counter() - t0,
                    }
                    self._bus.publish(Event(EventType.L2_LOAD_FINISHED, meta))
        except Exception as exc:
            reason = failure_reason(exc)
            self._failed(reason)
            with self._cond:
                self.counters[f"{op}_failures"] += 1
            failed = EventType.L2_STORE_FAILED if op == "store" else EventType.L2_LOAD_FAILED
            self._bus.publish(Event(failed, {"backend": self.backend, "keys": [key], "reason": reason}))
            self._log_failure(
                op, reason, "L2 %s %s of %032x failed (%s): %s", self.backend, op, key, reason, exc
            )
        finally:
            try:
                done(ok)
            except Exception:  # a broken callback must not leak the in-flight slot
                logger.exception("L2 %s completion callback failed", self.backend)
            with self._cond:
                self._inflight[op] -= 1
                self._cond.notify_all()


__all__ = ["AsyncL2"]
