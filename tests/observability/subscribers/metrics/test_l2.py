"""L2 metrics per backend: traffic, seconds, failures by reason, evictions, clears."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.metrics import L2MetricsSubscriber
from tests.helpers import event

DISK, REDIS = {"backend": "disk"}, {"backend": "redis"}


def test_l2_counters_per_backend(bus: EventBus, registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    bus.register_subscriber(L2MetricsSubscriber(registry, backends=["disk"]))
    assert v("kvcache_l2_store_chunks_total", DISK) == 0  # pre-created backend
    pub = bus.publish
    pub(
        event(
            EventType.L2_STORE_FINISHED,
            {"backend": "disk", "keys": [1, 2], "num_bytes": 2048, "duration_s": 0.5},
        )
    )
    pub(
        event(
            EventType.L2_LOAD_FINISHED,
            {"backend": "redis", "keys": [1], "num_bytes": 1024, "duration_s": 0.25},
        )
    )
    pub(event(EventType.L2_LOAD_FAILED, {"backend": "redis", "keys": [2], "reason": "corrupt"}))
    pub(event(EventType.L2_LOAD_FAILED, {"backend": "redis", "keys": [3], "reason": "corrupt"}))
    pub(event(EventType.L2_STORE_FAILED, {"backend": "disk", "keys": [4], "reason": "io"}))
    pub(event(EventType.L2_KEYS_EVICTED, {"backend": "disk", "keys": [1], "num_bytes": 1024}))
    pub(event(EventType.L2_CLEARED, {"backend": "disk", "num_keys": 1}))
    assert bus.flush(5)
    assert v("kvcache_l2_store_chunks_total", DISK) == 2
    assert v("kvcache_l2_store_bytes_total", DISK) == 2048
    assert v("kvcache_l2_store_seconds_total", DISK) == 0.5
    assert v("kvcache_l2_load_chunks_total", REDIS) == 1
    assert v("kvcache_l2_load_bytes_total", REDIS) == 1024
    assert v("kvcache_l2_load_seconds_total", REDIS) == 0.25
    assert v("kvcache_l2_load_chunks_total", DISK) == 0
    assert v("kvcache_l2_load_failures_total", {**REDIS, "reason": "corrupt"}) == 2
    assert v("kvcache_l2_store_failures_total", {**DISK, "reason": "io"}) == 1
    assert v("kvcache_l2_evicted_chunks_total", DISK) == 1
    assert v("kvcache_l2_evicted_bytes_total", DISK) == 1024
    assert v("kvcache_l2_clears_total", DISK) == 1
    assert v("kvcache_l2_clears_total", REDIS) == 0  # created with the backend's first event


def test_declined_chunks_and_bytes_per_backend(bus: EventBus, registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    bus.register_subscriber(L2MetricsSubscriber(registry, backends=["disk"]))
    assert v("kvcache_l2_declined_chunks_total", DISK) == 0
    meta = {"backend": "disk", "keys": [1, 2, 3], "num_bytes": 3072, "policy": "second-hit"}
    bus.publish(event(EventType.L2_STORE_DECLINED, meta))
    assert bus.flush(5)
    assert v("kvcache_l2_declined_chunks_total", DISK) == 3
    assert v("kvcache_l2_declined_bytes_total", DISK) == 3072
    assert v("kvcache_l2_store_bytes_total", DISK) == 0  # declined is not written


def test_checksum_failures_per_backend(bus: EventBus, registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    bus.register_subscriber(L2MetricsSubscriber(registry, backends=["disk"]))
    assert v("kvcache_l2_checksum_failures_total", DISK) == 0
    bus.publish(event(EventType.L2_CHECKSUM_FAILED, {"backend": "disk", "keys": [4], "detail": "payload"}))
    assert bus.flush(5)
    assert v("kvcache_l2_checksum_failures_total", DISK) == 1
