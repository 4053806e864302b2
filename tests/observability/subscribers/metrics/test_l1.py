"""L1 pool metrics: traffic, evictions, failures and occupancy gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.metrics import L1MetricsSubscriber
from tests.helpers import event


def test_l1_counters_and_gauges(bus: EventBus, registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    bus.register_subscriber(L1MetricsSubscriber(registry))
    assert v("kvcache_l1_write_chunks_total") == 0  # exists before the first event
    occ = {"used_bytes": 300, "capacity_bytes": 1000}
    bus.publish(event(EventType.L1_WRITE_FINISHED, {"keys": [1, 2, 3], "num_bytes": 300, **occ}))
    bus.publish(event(EventType.L1_READ_FINISHED, {"keys": [1, 2], "num_bytes": 200}))
    bus.publish(
        event(
            EventType.L1_KEYS_EVICTED,
            {"keys": [3], "num_bytes": 100, "used_bytes": 200, "capacity_bytes": 1000},
        )
    )
    bus.publish(
        event(
            EventType.L1_ALLOCATION_FAILED,
            {"requested_chunks": 9, "num_bytes": 900, "used_bytes": 200, "capacity_bytes": 1000},
        )
    )
    assert bus.flush(5)
    assert v("kvcache_l1_write_chunks_total") == 3
    assert v("kvcache_l1_write_bytes_total") == 300
    assert v("kvcache_l1_read_chunks_total") == 2
    assert v("kvcache_l1_read_bytes_total") == 200
    assert v("kvcache_l1_evicted_chunks_total") == 1
    assert v("kvcache_l1_evicted_bytes_total") == 100
    assert v("kvcache_l1_allocation_failures_total") == 1
    assert v("kvcache_l1_allocation_failed_bytes_total") == 900
    assert v("kvcache_l1_used_bytes") == 200
    assert v("kvcache_l1_capacity_bytes") == 1000
    bus.publish(event(EventType.L1_CLEARED, {"num_keys": 2}))
    assert bus.flush(5)
    assert v("kvcache_l1_clears_total") == 1
    assert v("kvcache_l1_used_bytes") == 0
