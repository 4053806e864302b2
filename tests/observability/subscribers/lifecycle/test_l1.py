"""L1 chunk lifecycle: lifetime, idle, reuse and evict->reuse gaps; sampling; memory bound."""

from __future__ import annotations

import gc
import math
import os

import pytest
from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.sampling import Sampler
from kvcache.observability.subscribers.lifecycle import L1LifecycleSubscriber
from tests.helpers import event

LIFETIME = "kvcache_l1_chunk_lifetime_seconds"
IDLE = "kvcache_l1_chunk_idle_before_evict_seconds"
REUSE = "kvcache_l1_chunk_reuse_gap_seconds"
EVICT_REUSE = "kvcache_l1_chunk_evict_reuse_gap_seconds"


class Harness:
    def __init__(
        self, bus: EventBus, registry: CollectorRegistry, rate: float = 1.0, cap: float = 300
    ) -> None:
        self.bus, self.registry = bus, registry
        self.sub = L1LifecycleSubscriber(rate, cap, registry)
        bus.register_subscriber(self.sub)

    def send(self, event_type: EventType, t: float, keys: list[int]) -> None:
        self.bus.publish(event(event_type, {"keys": keys, "num_bytes": 0}, timestamp=t))

    def write(self, t: float, *keys: int) -> None:
        self.send(EventType.L1_WRITE_FINISHED, t, list(keys))

    def read(self, t: float, *keys: int) -> None:
        self.send(EventType.L1_READ_FINISHED, t, list(keys))

    def evict(self, t: float, *keys: int) -> None:
        self.send(EventType.L1_KEYS_EVICTED, t, list(keys))

    def hist(self, name: str) -> tuple[float, float]:
        assert self.bus.flush(5)
        return (
            self.registry.get_sample_value(f"{name}_count") or 0.0,
            self.registry.get_sample_value(f"{name}_sum") or 0.0,
        )


@pytest.fixture
def h(bus: EventBus, registry: CollectorRegistry) -> Harness:
    return Harness(bus, registry)


def test_full_lifecycle_of_one_chunk(h: Harness) -> None:
    h.write(0, 1)
    h.read(10, 1)  # first gap: creation -> first read
    assert h.hist(REUSE) == (1, 10)
    h.read(25, 1)
    h.write(30, 1)  # a rewrite is an access too
    assert h.hist(REUSE) == (3, 30)
    h.evict(100, 1)
    assert h.hist(LIFETIME) == (1, 100)
    assert h.hist(IDLE) == (1, 70)
    h.write(160, 1)
    assert h.hist(EVICT_REUSE) == (1, 60)
    assert h.sub.tracked_chunks == 1 and h.sub.remembered_evictions == 0


def test_evict_reuse_gap_is_capped(bus: EventBus, registry: CollectorRegistry) -> None:
    h = Harness(bus, registry, cap=300)
    h.write(0, 1, 2)
    h.evict(10, 1, 2)
    h.write(309, 1)  # 299 s after eviction: recorded
    h.write(311, 2)  # 301 s: beyond the cap, not recorded
    assert h.hist(EVICT_REUSE) == (1, 299)


def test_stale_evictions_are_swept(h: Harness) -> None:
    keys = list(range(1000))
    h.write(0, *keys)
    h.evict(1, *keys[:500])
    h.evict(200, *keys[500:])
    assert h.bus.flush(5)
    assert h.sub.remembered_evictions == 1000
    h.write(302, 5000)  # 301 s after the first batch: it expires, the second stays
    assert h.bus.flush(5)
    assert h.sub.remembered_evictions == 500
    h.evict(600, 5000)
    assert h.bus.flush(5)
    assert h.sub.remembered_evictions == 1


def test_untracked_reads_and_evictions_are_ignored(h: Harness) -> None:
    h.read(5, 42)
    h.evict(6, 42)
    assert h.hist(REUSE) == (0, 0)
    assert h.hist(LIFETIME) == (0, 0)
    assert h.sub.tracked_chunks == 0


def test_clear_forgets_without_recording(h: Harness) -> None:
    h.write(0, 1, 2, 3)
    h.evict(1, 3)
    h.bus.publish(event(EventType.L1_CLEARED, {"num_keys": 2}, timestamp=2))
    h.write(3, 3)
    assert h.hist(LIFETIME) == (1, 1)
    assert h.hist(EVICT_REUSE) == (0, 0)
    assert h.sub.tracked_chunks == 1


def test_small_rate_samples_sequential_keys_uniformly(bus: EventBus, registry: CollectorRegistry) -> None:
    rate, n = 0.01, 100_000
    h = Harness(bus, registry, rate=rate)
    for start in range(0, n, 1000):
        h.write(0, *range(start, start + 1000))
    assert bus.flush(10)
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(h.sub.tracked_chunks - n * rate) < 5 * sigma
    # Stickiness: writing the same keys again changes nothing about which are tracked.
    for start in range(0, n, 1000):
        h.write(1, *range(start, start + 1000))
    assert bus.flush(10)
    expected = sum(Sampler(rate).sampled(k) for k in range(n))
    assert h.sub.tracked_chunks == expected
    assert h.hist(REUSE) == (expected, expected * 1.0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_memory_bounded_at_one_million_keys() -> None:
    sub = L1LifecycleSubscriber(0.001, 300.0, registry=None)
    on_write = sub.subscriptions()[EventType.L1_WRITE_FINISHED]
    on_evict = sub.subscriptions()[EventType.L1_KEYS_EVICTED]
    gc.collect()
    before = _rss_bytes()
    for start in range(0, 1_000_000, 10_000):
        keys = list(range(start, start + 10_000))
        on_write(event(EventType.L1_WRITE_FINISHED, {"keys": keys}, timestamp=start))
        if start >= 500_000:  # evict the older half as we go
            old = list(range(start - 500_000, start - 490_000))
            on_evict(event(EventType.L1_KEYS_EVICTED, {"keys": old}, timestamp=start))
    del keys, old
    gc.collect()
    grown = _rss_bytes() - before
    assert 300 < sub.tracked_chunks < 700  # ~500 resident keys sampled at 0.1 %
    assert sub.remembered_evictions < 700
    # Tracking all 500k resident keys would take well over 50 MB; sampled, it stays small.
    assert grown < 8 * 1024 * 1024, f"RSS grew {grown} bytes over 1M keys"


CHUNK = 1 << 20


def _write(sub: L1LifecycleSubscriber, t: float, keys: list[int], capacity: int | None = None) -> None:
    md: dict[str, object] = {"keys": keys, "num_bytes": CHUNK * len(keys)}
    if capacity is not None:
        md["capacity_bytes"], md["used_bytes"] = capacity, capacity
    sub._on_write(event(EventType.L1_WRITE_FINISHED, md, timestamp=t))


def _dropped(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("kvcache_l1_lifecycle_dropped_total", {"reason": reason})


def test_evictions_remove_tracked_chunks(registry: CollectorRegistry) -> None:
    sub = L1LifecycleSubscriber(1.0, 300.0, registry=registry)
    for i in range(1000):
        if i >= 100:  # L1 holds 100 chunks: room for each write comes from the oldest
            sub._on_evict(event(EventType.L1_KEYS_EVICTED, {"keys": [i - 100]}, timestamp=float(i)))
        _write(sub, float(i), [i], capacity=100 * CHUNK)
    assert sub.tracked_chunks == 100
    assert _dropped(registry, "chunk_cap") == 0


def test_lost_evictions_cannot_grow_the_state_beyond_l1_capacity(registry: CollectorRegistry) -> None:
    """20k chunks written into a 100-chunk L1 whose evictions never reach the subscriber
    (dropped by a full bus, or delivered before the write): tracking stays within L1."""
    sub = L1LifecycleSubscriber(1.0, 300.0, registry=registry)
    for i in range(20_000):
        _write(sub, float(i), [i], capacity=100 * CHUNK)
    assert sub.tracked_chunks == 100
    assert sorted(sub._chunks) == list(range(19_900, 20_000))  # the most recently used stay
    assert _dropped(registry, "chunk_cap") == 19_900


def test_a_chunk_still_read_is_dropped_last(registry: CollectorRegistry) -> None:
    sub = L1LifecycleSubscriber(1.0, 300.0, registry=registry)
    hot = 2**128 - 1
    _write(sub, 0.0, [hot], capacity=10 * CHUNK)
    for i in range(1000):
        _write(sub, float(i), [i], capacity=10 * CHUNK)
        sub._on_read(event(EventType.L1_READ_FINISHED, {"keys": [hot]}, timestamp=float(i)))
    assert hot in sub._chunks and sub.tracked_chunks == 10


def test_without_capacity_the_explicit_cap_bounds_chunks_and_evictions(registry: CollectorRegistry) -> None:
    sub = L1LifecycleSubscriber(1.0, 300.0, registry=registry, max_tracked=1000)
    for start in range(0, 100_000, 1000):
        keys = list(range(start, start + 1000))
        sub._on_write(event(EventType.L1_WRITE_FINISHED, {"keys": keys}, timestamp=start / 1000))
        sub._on_evict(event(EventType.L1_KEYS_EVICTED, {"keys": keys}, timestamp=start / 1000))
    # 100k evictions within the 300 s reuse window: only the latest 1000 are remembered.
    assert sub.remembered_evictions == 1000
    assert sub.tracked_chunks <= 1000
    assert _dropped(registry, "eviction_cap") == 99_000
