"""Lifecycle of kvcache's own chunks in L1: lifetime, idle time, reuse and re-fetch gaps.

A separate subscriber from ``L1MetricsSubscriber`` because it keeps per-chunk state;
operators enable it to size L1 (how long chunks live, how long they sit unused before
eviction, how soon an evicted chunk is wanted again). L1 keys are unbounded, so a chunk
is tracked only if a stable, well-mixed hash of its key falls under the sample rate
(``Sampler``): the decision needs no memory and is the same every time the key appears.

Per sampled key:

* L1_WRITE_FINISHED of an untracked key starts tracking (creation = now). If the key was
  evicted less than ``max_evict_reuse_wait`` seconds ago, the evict->reuse gap is recorded.
* L1_WRITE_FINISHED or L1_READ_FINISHED of a tracked key records the reuse gap
  (now - previous access) at that moment; the first gap runs from the creation.
* L1_KEYS_EVICTED of a tracked key records lifetime (now - creation) and idle-before-evict
  (now - last access), then remembers the eviction time for the evict->reuse gap.
* L1_READ_FINISHED of an untracked key is ignored (it was written before tracking began,
  so its lifetime is unknown).
* L1_CLEARED forgets everything without recording (a clear is not cache pressure).

Remembered evictions expire after ``max_evict_reuse_wait`` seconds; they are kept in
eviction order and expired from the oldest end on every event, so each entry is removed
once (amortised O(1), no scan of the whole map).

Bounded state. An eviction removes its tracked chunk, so tracked chunks are those resident
in L1 -- as long as every eviction arrives after its write. One that is lost (a full bus
drops it) or overtakes its write (published by another thread) would leave an entry
forever, so tracked chunks are also capped by what L1 can hold: ``capacity_bytes`` over the
smallest chunk seen in L1_WRITE_FINISHED (and by ``max_tracked`` in any case); past the
cap the least recently accessed goes first. Remembered evictions are capped by
``max_tracked`` too, oldest first. Drops are counted in
``kvcache_l1_lifecycle_dropped_total{reason}``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, L1KeysEvicted, L1ReadFinished, L1WriteFinished
from kvcache.observability.instruments import LIFETIME_SECONDS, MetricSet
from kvcache.observability.sampling import Sampler, mix64

DEFAULT_MAX_TRACKED = 1 << 20

EVICT_REUSE_SECONDS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0)


class L1LifecycleSubscriber(EventSubscriber):
    """Sampled chunk-lifecycle histograms for L1; see METRICS.md."""

    def __init__(
        self,
        sample_rate: float,
        max_evict_reuse_wait: float,
        registry: CollectorRegistry | None,
        max_tracked: int = DEFAULT_MAX_TRACKED,
    ) -> None:
        """``max_tracked``: most chunks tracked, and most evictions remembered, at once
        (tracked chunks are also capped by L1's capacity, learnt from the events)."""
        self.sampler = Sampler(sample_rate)
        if max_evict_reuse_wait <= 0:
            raise ValueError(f"max_evict_reuse_wait must be > 0, got {max_evict_reuse_wait}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        self.max_evict_reuse_wait = max_evict_reuse_wait
        self.max_tracked = max_tracked
        self._chunk_cap = max_tracked  # lowered by what L1 can hold
        self._min_chunk_bytes = math.inf
        self._threshold = self.sampler.threshold
        m = self.metrics = MetricSet()
        self._lifetime = m.histogram(
            "kvcache_l1_chunk_lifetime_seconds",
            "L1 chunk: write to eviction (sampled chunks).",
            LIFETIME_SECONDS,
        )
        self._idle = m.histogram(
            "kvcache_l1_chunk_idle_before_evict_seconds",
            "L1 chunk: last read or write to eviction (sampled chunks).",
            LIFETIME_SECONDS,
        )
        self._reuse_gap = m.histogram(
            "kvcache_l1_chunk_reuse_gap_seconds",
            "L1 chunk: time between consecutive accesses (sampled chunks).",
            LIFETIME_SECONDS,
        )
        self._evict_reuse_gap = m.histogram(
            "kvcache_l1_chunk_evict_reuse_gap_seconds",
            "L1 chunk: eviction to the next write of the same key, up to the cap (sampled).",
            EVICT_REUSE_SECONDS,
        )
        dropped = m.add(
            "kvcache_l1_lifecycle_dropped_total",
            "L1 lifecycle state dropped at a cap: chunks beyond what L1 holds (their eviction "
            "was lost), evictions beyond max_tracked.",
            "counter",
            ("reason",),
        )
        self._dropped_chunks = dropped.counter("chunk_cap")
        self._dropped_evictions = dropped.counter("eviction_cap")
        # key -> [created, last_access]; least recently accessed first. OrderedDict, not
        # dict: dropping the first entry of a dict over and over is quadratic.
        self._chunks: OrderedDict[int, list[float]] = OrderedDict()
        # key -> eviction time, oldest first
        self._evicted: OrderedDict[int, float] = OrderedDict()
        if registry is not None:
            m.register(registry)

    @property
    def tracked_chunks(self) -> int:
        """Chunks currently tracked (resident in L1 and sampled)."""
        return len(self._chunks)

    @property
    def chunk_cap(self) -> int:
        """The most chunks tracked at once: ``max_tracked``, or fewer if L1 holds fewer."""
        return self._chunk_cap

    @property
    def remembered_evictions(self) -> int:
        """Evicted sampled chunks still inside the evict->reuse window."""
        return len(self._evicted)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.L1_WRITE_FINISHED: self._on_write,
            EventType.L1_READ_FINISHED: self._on_read,
            EventType.L1_KEYS_EVICTED: self._on_evict,
            EventType.L1_CLEARED: self._on_cleared,
        }

    def _expire(self, now: float) -> None:
        evicted = self._evicted
        horizon = now - self.max_evict_reuse_wait
        while evicted:
            when = evicted[next(iter(evicted))]
            if when >= horizon:
                return
            evicted.popitem(last=False)

    def _learn_capacity(self, capacity: int, per_chunk: float) -> None:
        """Lower the chunk cap to what L1 can hold: capacity / smallest chunk written."""
        self._min_chunk_bytes = per_chunk
        self._chunk_cap = max(1, min(self.max_tracked, int(capacity // per_chunk)))

    def _on_write(self, event: Event) -> None:
        now = event.timestamp
        assert now is not None
        self._expire(now)
        md = cast(L1WriteFinished, event.metadata)
        keys = md.keys
        capacity = md.capacity_bytes
        if keys:  # a smaller chunk than any so far: fewer fit in L1
            nbytes = md.num_bytes
            if 0 < nbytes < self._min_chunk_bytes * len(keys):
                self._learn_capacity(capacity, nbytes / len(keys))
        chunks = self._chunks
        threshold = self._threshold
        for key in keys:
            state = chunks.get(key)
            if state is not None:  # rewrite of a tracked chunk; now the most recent
                chunks.move_to_end(key)
                self._reuse_gap.observe(now - state[1])
                state[1] = now
                continue
            if mix64(key) >= threshold:
                continue
            evicted_at = self._evicted.pop(key, None)
            if evicted_at is not None and now - evicted_at <= self.max_evict_reuse_wait:
                self._evict_reuse_gap.observe(now - evicted_at)
            chunks[key] = [now, now]
        cap = self._chunk_cap
        while len(chunks) > cap:  # its eviction never came: least recently accessed first
            chunks.popitem(last=False)
            self._dropped_chunks.inc()

    def _on_read(self, event: Event) -> None:
        now = event.timestamp
        assert now is not None
        chunks = self._chunks
        for key in cast(L1ReadFinished, event.metadata).keys:
            state = chunks.get(key)
            if state is not None:
                chunks.move_to_end(key)  # now the most recent
                self._reuse_gap.observe(now - state[1])
                state[1] = now

    def _on_evict(self, event: Event) -> None:
        now = event.timestamp
        assert now is not None
        self._expire(now)
        chunks = self._chunks
        for key in cast(L1KeysEvicted, event.metadata).keys:
            state = chunks.pop(key, None)
            if state is None:
                continue
            self._lifetime.observe(now - state[0])
            self._idle.observe(now - state[1])
            self._evicted.pop(key, None)
            self._evicted[key] = now
        evicted = self._evicted
        while len(evicted) > self.max_tracked:
            evicted.popitem(last=False)
            self._dropped_evictions.inc()

    def _on_cleared(self, event: Event) -> None:
        self._chunks.clear()
        self._evicted.clear()


__all__ = ["DEFAULT_MAX_TRACKED", "EVICT_REUSE_SECONDS", "L1LifecycleSubscriber"]
