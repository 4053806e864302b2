"""L0 (GPU block) lifecycle: every classification case with explicit timestamps."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import BlockAllocationRecord, EventType
from kvcache.observability.sampling import Sampler
from kvcache.observability.subscribers.lifecycle import L0LifecycleSubscriber
from tests.helpers import event

LIFETIME = "kvcache_l0_block_lifetime_seconds"
IDLE = "kvcache_l0_block_idle_before_evict_seconds"
REUSE = "kvcache_l0_block_reuse_gap_seconds"


class Harness:
    def __init__(self, bus: EventBus, registry: CollectorRegistry, rate: float = 1.0) -> None:
        self.bus, self.registry = bus, registry
        self.sub = L0LifecycleSubscriber(rate, registry)
        bus.register_subscriber(self.sub)

    def alloc(
        self,
        t: float,
        req: str,
        blocks: list[int],
        tokens: list[int],
        instance: int = 1,
        model: str = "m",
        block_size: int | None = None,
    ) -> None:
        md: dict[str, object] = {
            "instance_id": instance,
            "model_name": model,
            "records": [BlockAllocationRecord(req, blocks, tokens)],
        }
        if block_size is not None:
            md["block_size"] = block_size
        self.bus.publish(event(EventType.MP_VLLM_BLOCK_ALLOCATION, md, timestamp=t))

    def end(self, t: float, req: str, instance: int = 1, model: str = "m") -> None:
        md = {"instance_id": instance, "model_name": model, "request_id": req}
        self.bus.publish(event(EventType.MP_VLLM_END_SESSION, md, timestamp=t))

    def hist(self, name: str, instance: int = 1, model: str = "m") -> tuple[float, float]:
        assert self.bus.flush(5)
        labels = {"instance_id": str(instance), "model_name": model}
        count = self.registry.get_sample_value(f"{name}_count", labels)
        total = self.registry.get_sample_value(f"{name}_sum", labels)
        return (count or 0.0, total or 0.0)


@pytest.fixture
def h(bus: EventBus, registry: CollectorRegistry) -> Harness:
    return Harness(bus, registry)


def test_new_block_records_nothing(h: Harness) -> None:
    h.alloc(100, "A", [5], [1, 2, 3])
    assert h.hist(LIFETIME) == (0, 0)
    assert h.hist(REUSE) == (0, 0)
    assert h.sub.tracked_blocks == 1


def test_decode_continuation_is_ignored(h: Harness) -> None:
    h.alloc(100, "A", [5], [1, 2, 3])
    h.alloc(101, "A", [5], [4])  # same request, new tokens into its own block
    h.alloc(102, "A", [5, 6], [5])
    assert h.hist(LIFETIME) == (0, 0)
    assert h.hist(REUSE) == (0, 0)
    assert h.hist(IDLE) == (0, 0)


def test_true_reuse_records_gap_at_the_hit(h: Harness) -> None:
    h.alloc(100, "A", [5], [1, 2, 3])
    h.end(110, "A")
    h.alloc(130, "B", [5], [1, 2, 3])  # first gap: allocation -> first reuse
    assert h.hist(REUSE) == (1, 30)
    h.end(140, "B")
    h.alloc(200, "C", [5], [1, 2, 3])  # second gap: previous reuse -> this one
    assert h.hist(REUSE) == (2, 100)
    assert h.hist(LIFETIME) == (0, 0)  # recorded now, not deferred to an eviction


def test_prefix_sharing_is_co_ownership_not_reuse(h: Harness) -> None:
    h.alloc(100, "A", [5], [1, 2, 3])
    h.alloc(105, "B", [5], [1, 2, 3])  # A still live: B shares the block
    assert h.hist(REUSE) == (0, 0)
    h.end(110, "A")
    h.alloc(115, "C", [5], [1, 2, 3])  # B still owns it: still sharing
    assert h.hist(REUSE) == (0, 0)
    h.end(120, "B")
    h.end(125, "C")
    h.alloc(160, "D", [5], [1, 2, 3])  # nobody owns it: reuse, gap from the allocation
    assert h.hist(REUSE) == (1, 60)


def test_different_tokens_is_an_eviction(h: Harness) -> None:
    h.alloc(100, "A", [5], [1, 2, 3])
    h.end(110, "A")
    h.alloc(150, "B", [5], [9, 9, 9])
    assert h.hist(LIFETIME) == (1, 50)  # 150 - 100
    assert h.hist(IDLE) == (1, 40)  # 150 - 110 (release was the last access)
    h.end(170, "B")
    h.alloc(175, "C", [5], [9, 9, 9])  # the new content's lifetime started at 150
    assert h.hist(REUSE) == (1, 25)


def test_idle_counts_from_latest_access(h: Harness) -> None:
    h.alloc(0, "A", [5], [1])
    h.end(10, "A")
    h.alloc(20, "B", [5], [1])  # reuse (gap 20)
    h.end(50, "B")
    h.alloc(80, "C", [5], [2])  # eviction
    assert h.hist(LIFETIME) == (1, 80)
    assert h.hist(IDLE) == (1, 30)


def test_block_size_splits_record_tokens_per_block(h: Harness) -> None:
    h.alloc(0, "A", [0, 1], [1, 2, 3, 4], block_size=2)
    h.end(10, "A")
    h.alloc(30, "B", [0, 1], [1, 2, 7, 7], block_size=2)
    assert h.hist(REUSE) == (1, 30)  # block 0 holds (1, 2) again
    assert h.hist(LIFETIME) == (1, 30)  # block 1 went from (3, 4) to (7, 7)


def test_multi_instance_attribution(h: Harness) -> None:
    # One scheduler step of two instances: the publisher sends one event per instance.
    h.alloc(0, "A", [5], [1, 2], instance=1, model="llama")
    h.alloc(0, "A", [5], [8, 9], instance=2, model="qwen")  # same block id, other instance
    h.end(10, "A", instance=1, model="llama")
    h.end(10, "A", instance=2, model="qwen")
    h.alloc(40, "B", [5], [1, 2], instance=1, model="llama")  # reuse in instance 1
    h.alloc(60, "B", [5], [3, 3], instance=2, model="qwen")  # eviction in instance 2
    assert h.hist(REUSE, 1, "llama") == (1, 40)
    assert h.hist(LIFETIME, 1, "llama") == (0, 0)
    assert h.hist(REUSE, 2, "qwen") == (0, 0)
    assert h.hist(LIFETIME, 2, "qwen") == (1, 60)
    assert h.hist(IDLE, 2, "qwen") == (1, 50)


def test_sampling_is_sticky_and_bounded(bus: EventBus, registry: CollectorRegistry) -> None:
    h = Harness(bus, registry, rate=0.1)
    blocks = list(range(2000))
    expected = sum(h.sub.sampler.sampled_block(1, b) for b in blocks)
    assert 100 < expected < 300
    for rnd in range(10):  # each round overwrites every block with new content
        for b in blocks:
            h.alloc(rnd * 100, f"r{rnd}-{b}", [b], [rnd])
        for b in blocks:
            h.end(rnd * 100 + 50, f"r{rnd}-{b}")
        assert bus.flush(10)
        # Same blocks every round: a re-rolled decision would drift towards all 2000.
        assert h.sub.tracked_blocks == expected
    assert h.hist(LIFETIME) == (9 * expected, 9 * expected * 100)


def test_sampler_decision_matches_public_sampler() -> None:
    sub = L0LifecycleSubscriber(0.25, registry=None)
    ref = Sampler(0.25)
    assert all(
        sub.sampler.sampled_block(i, b) == ref.sampled_block(i, b) for i in (1, 2) for b in range(1000)
    )


def test_series_exist_at_zero(registry: CollectorRegistry) -> None:
    L0LifecycleSubscriber(0.5, registry, instances=[(3, "m3")])
    labels = {"instance_id": "3", "model_name": "m3"}
    for name in (LIFETIME, IDLE, REUSE):
        assert registry.get_sample_value(f"{name}_count", labels) == 0
        assert registry.get_sample_value(f"{name}_bucket", {**labels, "le": "+Inf"}) == 0


def _alloc(sub: L0LifecycleSubscriber, t: float, instance: int, *records: BlockAllocationRecord) -> None:
    md = {"instance_id": instance, "model_name": "m", "records": list(records), "block_size": 1}
    sub._on_allocation(event(EventType.MP_VLLM_BLOCK_ALLOCATION, md, timestamp=t))


def _dropped(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("kvcache_l0_lifecycle_dropped_total", {"reason": reason})


def _series(registry: CollectorRegistry, name: str) -> int:
    return sum(1 for fam in registry.collect() for s in fam.samples if s.name == f"{name}_count")


def test_requests_that_never_end_cannot_grow_the_state_without_bound(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """A buggy engine reports 20k requests sharing one prefix block and never ends any."""
    sub = L0LifecycleSubscriber(1.0, registry, max_requests=1000)
    with caplog.at_level(logging.WARNING, logger="kvcache.observability"):
        for i in range(20_000):  # one event per second of (explicit) event time
            _alloc(sub, float(i), 1, BlockAllocationRecord(f"r{i}", [0, 1], [7, 7]))
    assert sub.tracked_requests == 1000 and sub.requests_dropped == 19_000
    assert sub.tracked_blocks == 2
    assert max(len(b.owners) for b in sub._instances[1].blocks.values()) <= 1000  # shared-block owners too
    assert _dropped(registry, "request_cap") == 19_000
    # Logged, but not once per drop: at most once a minute of event time.
    warnings = [r for r in caplog.records if "never ended" in r.getMessage()]
    assert 1 <= len(warnings) <= 20_000 / 60 + 1


def test_default_caps_hold_under_a_flood(registry: CollectorRegistry) -> None:
    """Never-ended requests past the default cap (65,536), sharing the prefixes of a
    4096-block cache."""
    sub = L0LifecycleSubscriber(1.0, registry)
    for i in range((1 << 16) + 4096):
        _alloc(sub, float(i), 1, BlockAllocationRecord(f"r{i}", [i % 4096], [i % 4096]))
    assert sub.tracked_requests == sub.max_requests == 1 << 16
    assert sub.tracked_blocks == 4096  # bounded by the cache, not by the requests


def test_dropping_at_the_cap_costs_the_same_whatever_the_cap() -> None:
    """Each drop is O(1): a plain dict emptied from the front rescans its deleted slots, which
    made a 65k-request flood ~100x slower per drop than a 1k one (a stalled dispatcher)."""

    def seconds_per_drop(cap: int) -> float:
        sub = L0LifecycleSubscriber(1.0, registry=None, max_requests=cap)
        for i in range(cap):
            _alloc(sub, 0.0, 1, BlockAllocationRecord(f"r{i}", [0], [1]))
        start = time.perf_counter()
        for i in range(cap, cap + 20_000):
            _alloc(sub, 0.0, 1, BlockAllocationRecord(f"r{i}", [0], [1]))
        assert sub.requests_dropped == 20_000
        return (time.perf_counter() - start) / 20_000

    assert seconds_per_drop(1 << 16) < 5 * seconds_per_drop(1 << 10)


def test_a_request_still_reporting_is_dropped_last(registry: CollectorRegistry) -> None:
    sub = L0LifecycleSubscriber(1.0, registry, max_requests=100)
    _alloc(sub, 0.0, 1, BlockAllocationRecord("live", [0], [1]))
    for i in range(10_000):
        _alloc(sub, float(i), 1, BlockAllocationRecord(f"leak{i}", [1 + i % 50], [1 + i % 50]))
        if i % 50 == 0:  # the live request keeps decoding into its block
            _alloc(sub, float(i), 1, BlockAllocationRecord("live", [0], [2]))
    assert sub.tracked_requests == 100
    assert (1, "live") in sub._requests
    # Its block is still owned (no spurious release, hence no spurious reuse later).
    assert sub._instances[1].blocks[0].owners == {"live"}


def test_unregistering_an_instance_releases_its_state_but_keeps_its_series(
    registry: CollectorRegistry,
) -> None:
    sub = L0LifecycleSubscriber(1.0, registry)
    for instance in (1, 2):
        _alloc(sub, 0.0, instance, BlockAllocationRecord("A", [0, 1, 2], [1, 2, 3]))
    assert sub.tracked_instances == 2 and sub.tracked_blocks == 6 and sub.tracked_requests == 2
    md = {"instance_id": 1, "model_name": "m"}
    sub.subscriptions()[EventType.INSTANCE_UNREGISTERED](
        event(EventType.INSTANCE_UNREGISTERED, md, timestamp=1.0)
    )
    assert sub.tracked_blocks == 3 and sub.tracked_requests == 1
    # The finished engine's histograms still reach the next scrape (the instance cap retires them).
    assert registry.get_sample_value(f"{LIFETIME}_count", {"instance_id": "1", "model_name": "m"}) == 0
    assert registry.get_sample_value(f"{LIFETIME}_count", {"instance_id": "2", "model_name": "m"}) == 0
    # An unknown or repeated unregister is harmless.
    sub.subscriptions()[EventType.INSTANCE_UNREGISTERED](
        event(EventType.INSTANCE_UNREGISTERED, md, timestamp=2.0)
    )
    assert sub.tracked_blocks == 3


def test_instances_that_never_unregister_are_bounded(registry: CollectorRegistry) -> None:
    """10k instance ids (engines restarting with random ids, unregister events lost)."""
    sub = L0LifecycleSubscriber(1.0, registry, max_instances=100)
    for instance in range(10_000):
        _alloc(sub, float(instance), instance, BlockAllocationRecord("A", [0, 1], [1, 2]))
    assert sub.tracked_instances == 100
    assert sub.tracked_blocks == 200 and sub.tracked_requests == 100
    assert sorted(sub._instances) == list(range(9_900, 10_000))  # the most recent stay
    for name in (LIFETIME, IDLE, REUSE):  # and so does the exposition: no series per dead id
        assert _series(registry, name) == 100
    assert _dropped(registry, "instance_cap") == 9_900


def test_an_instance_id_reused_for_another_model_starts_over(registry: CollectorRegistry) -> None:
    sub = L0LifecycleSubscriber(1.0, registry)
    _alloc(sub, 0.0, 1, BlockAllocationRecord("A", [0], [1]))
    md = {"instance_id": 1, "model_name": "other", "records": [BlockAllocationRecord("B", [0], [9])]}
    sub._on_allocation(event(EventType.MP_VLLM_BLOCK_ALLOCATION, md, timestamp=5.0))
    # Block 0 of another model's cache is another block: no eviction of the old content.
    assert registry.get_sample_value(f"{LIFETIME}_count", {"instance_id": "1", "model_name": "other"}) == 0
    assert registry.get_sample_value(f"{LIFETIME}_count", {"instance_id": "1", "model_name": "m"}) is None
    assert sub.tracked_requests == 1 and sub.tracked_blocks == 1
