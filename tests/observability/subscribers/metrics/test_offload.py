"""Offload transfer metrics (vLLM-style): bytes, seconds, size and throughput per direction."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import Event, EventType
from kvcache.observability.subscribers.metrics import OffloadMetricsSubscriber
from tests.helpers import event

L = {"instance_id": "1", "model_name": "m"}


def end(event_type: EventType, nbytes: int, seconds: float) -> Event:
    md = {
        "instance_id": 1,
        "model_name": "m",
        "device": "cpu",
        "num_bytes": nbytes,
        "transfer_seconds": seconds,
        "success": True,
    }
    return event(event_type, md, "s", 1.0)


def test_store_and_load_totals_and_histograms(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(OffloadMetricsSubscriber(registry))
    bus.publish(end(EventType.MP_STORE_END, 4_000_000_000, 1.0))  # 4 GB/s
    bus.publish(end(EventType.MP_STORE_END, 1_000_000_000, 1.0))  # 1 GB/s
    bus.publish(end(EventType.MP_STORE_END, 0, 0.0))  # nothing copied: no observation
    bus.publish(end(EventType.MP_RETRIEVE_END, 3 << 20, 0.001))
    assert bus.flush(5)
    v = registry.get_sample_value
    assert v("kvcache_offload_store_bytes_total", L) == 5_000_000_000
    assert v("kvcache_offload_store_seconds_total", L) == 2.0
    assert v("kvcache_offload_store_size_bytes_count", L) == 2
    assert v("kvcache_offload_store_size_bytes_sum", L) == 5_000_000_000
    assert v("kvcache_offload_store_throughput_bytes_per_second_count", L) == 2
    assert v("kvcache_offload_store_throughput_bytes_per_second_sum", L) == 5e9
    assert v("kvcache_offload_store_throughput_bytes_per_second_bucket", {**L, "le": "1e+09"}) == 1
    # Average throughput is sum(bytes) / sum(seconds) = 2.5 GB/s, not mean of rates.
    assert v("kvcache_offload_load_bytes_total", L) == 3 << 20
    assert v("kvcache_offload_load_seconds_total", L) == 0.001
    assert v("kvcache_offload_load_size_bytes_bucket", {**L, "le": "4.194304e+06"}) == 1
    assert v("kvcache_offload_load_size_bytes_bucket", {**L, "le": "1.048576e+06"}) == 0


def test_series_exist_at_zero(registry: CollectorRegistry) -> None:
    OffloadMetricsSubscriber(registry, instances=[(1, "m")])
    assert registry.get_sample_value("kvcache_offload_load_bytes_total", L) == 0
    assert registry.get_sample_value("kvcache_offload_store_size_bytes_count", L) == 0


def test_label_sets_past_the_cap_leave_least_recently_reported_first(
    bus: EventBus, registry: CollectorRegistry
) -> None:
    """As the engine metrics: past the cap, the least recently reported instance's series go."""
    bus.register_subscriber(OffloadMetricsSubscriber(registry, [(1, "m"), (2, "old")], max_label_sets=2))
    bus.publish(end(EventType.MP_STORE_END, 1 << 20, 0.001))  # instance 1 reported: 2 is older
    md = {"instance_id": 3, "model_name": "new", "device": "cpu", "num_bytes": 8,
          "transfer_seconds": 0.1, "success": True}  # fmt: skip
    bus.publish(event(EventType.MP_STORE_END, md, "s", 2.0))
    assert bus.flush(5)
    v = registry.get_sample_value
    for name in ("kvcache_offload_store_bytes_total", "kvcache_offload_load_size_bytes_count"):
        assert v(name, {"instance_id": "2", "model_name": "old"}) is None, name
    assert v("kvcache_offload_store_bytes_total", L) == 1 << 20
    assert v("kvcache_offload_store_bytes_total", {"instance_id": "3", "model_name": "new"}) == 8
