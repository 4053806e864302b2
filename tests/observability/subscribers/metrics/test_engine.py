"""Engine operation metrics: exact counts per instance/model, START->END latency pairing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.metrics import EngineMetricsSubscriber
from tests.helpers import event

I1 = {"instance_id": "1", "model_name": "llama"}
I2 = {"instance_id": "2", "model_name": "qwen"}


def md(instance: int = 1, model: str = "llama", **kw: object) -> dict[str, object]:
    return {"instance_id": instance, "model_name": model, "device": "cpu", **kw}


def test_store_counts_and_latency(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(EngineMetricsSubscriber(registry))
    bus.publish(event(EventType.MP_STORE_START, md(num_tokens=512), "op1", 10.0))
    bus.publish(
        event(
            EventType.MP_STORE_END,
            md(
                num_tokens=512,
                stored_chunks=1,
                skipped_chunks=1,
                failed_chunks=0,
                stored_tokens=256,
                num_bytes=1 << 20,
                transfer_seconds=0.001,
                success=True,
            ),
            "op1",
            10.004,
        )
    )
    bus.publish(event(EventType.MP_STORE_START, md(num_tokens=256), "op2", 11.0))
    bus.publish(
        event(
            EventType.MP_STORE_END,
            md(
                num_tokens=256,
                stored_chunks=0,
                skipped_chunks=0,
                failed_chunks=1,
                stored_tokens=0,
                num_bytes=0,
                transfer_seconds=0.0,
                success=False,
            ),
            "op2",
            11.5,
        )
    )
    assert bus.flush(5)
    v = registry.get_sample_value
    assert v("kvcache_store_requests_total", I1) == 2
    assert v("kvcache_store_failures_total", I1) == 1
    assert v("kvcache_store_requested_tokens_total", I1) == 768
    assert v("kvcache_store_stored_tokens_total", I1) == 256
    assert v("kvcache_store_stored_chunks_total", I1) == 1
    assert v("kvcache_store_skipped_chunks_total", I1) == 1
    assert v("kvcache_store_failed_chunks_total", I1) == 1
    assert v("kvcache_store_duration_seconds_count", I1) == 2
    assert abs(v("kvcache_store_duration_seconds_sum", I1) - 0.504) < 1e-9  # type: ignore[operator]
    assert v("kvcache_store_duration_seconds_bucket", {**I1, "le": "0.005"}) == 1


def test_retrieve_and_lookup_counts(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(EngineMetricsSubscriber(registry))
    bus.publish(
        event(
            EventType.MP_RETRIEVE_END,
            md(
                num_tokens=1024,
                skip_tokens=256,
                retrieved_tokens=768,
                l1_tokens=256,
                l2_tokens=256,
                missing_tokens=256,
                num_bytes=1000,
                transfer_seconds=0.01,
                success=True,
            ),
            "r",
            1.0,
        )
    )
    bus.publish(
        event(
            EventType.MP_LOOKUP_END,
            md(num_tokens=1000, hit_tokens=512, l1_hit_tokens=256, l2_hit_tokens=256),
            "l",
            2.0,
        )
    )
    bus.publish(
        event(
            EventType.MP_LOOKUP_END,
            md(2, "qwen", num_tokens=100, hit_tokens=0, l1_hit_tokens=0, l2_hit_tokens=0),
            "l",
            2.0,
        )
    )
    assert bus.flush(5)
    v = registry.get_sample_value
    assert v("kvcache_retrieve_requests_total", I1) == 1
    assert v("kvcache_retrieve_failures_total", I1) == 0
    assert v("kvcache_retrieve_requested_tokens_total", I1) == 1024
    assert v("kvcache_retrieve_retrieved_tokens_total", I1) == 768
    assert v("kvcache_retrieve_skipped_tokens_total", I1) == 256
    assert v("kvcache_retrieve_l1_tokens_total", I1) == 256
    assert v("kvcache_retrieve_l2_tokens_total", I1) == 256
    assert v("kvcache_retrieve_missing_tokens_total", I1) == 256
    assert v("kvcache_retrieve_duration_seconds_count", I1) == 0  # no START seen
    assert v("kvcache_lookup_requests_total", I1) == 1
    assert v("kvcache_lookup_requested_tokens_total", I1) == 1000
    assert v("kvcache_lookup_hit_tokens_total", I1) == 512
    assert v("kvcache_lookup_l1_hit_tokens_total", I1) == 256
    assert v("kvcache_lookup_l2_hit_tokens_total", I1) == 256
    assert v("kvcache_lookup_requests_total", I2) == 1
    assert v("kvcache_lookup_requested_tokens_total", I2) == 100


def test_tp_workers_sharing_a_session_pair_by_device(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(EngineMetricsSubscriber(registry))
    for dev, t0 in (("cuda:0", 0.0), ("cuda:1", 0.5)):
        m = {**md(num_tokens=1), "device": dev}
        bus.publish(event(EventType.MP_RETRIEVE_START, m, "req-1", t0))
    for dev, t1 in (("cuda:1", 0.6), ("cuda:0", 0.2)):
        m = {**md(num_tokens=1), "device": dev}
        bus.publish(event(EventType.MP_RETRIEVE_END, m, "req-1", t1))
    assert bus.flush(5)
    assert registry.get_sample_value("kvcache_retrieve_duration_seconds_count", I1) == 2
    total = registry.get_sample_value("kvcache_retrieve_duration_seconds_sum", I1)
    assert abs(total - 0.3) < 1e-9  # type: ignore[operator]  # 0.2 + 0.1, never 0.6 or -0.3


def test_all_series_of_an_instance_exist_at_zero(registry: CollectorRegistry) -> None:
    EngineMetricsSubscriber(registry, instances=[(1, "llama")])
    for name in (
        "kvcache_store_requests_total",
        "kvcache_retrieve_missing_tokens_total",
        "kvcache_lookup_hit_tokens_total",
        "kvcache_lookup_duration_seconds_count",
    ):
        assert registry.get_sample_value(name, I1) == 0


def test_label_sets_past_the_cap_leave_least_recently_reported_first(
    bus: EventBus, registry: CollectorRegistry
) -> None:
    """Engines come and go (restarts, new instance ids): the series of one that left stay
    (its last figures reach the next scrape) until the cap pushes them out, least recently
    reported first, so the scrape and the daemon never grow without bound."""
    bus.register_subscriber(EngineMetricsSubscriber(registry, [(1, "llama"), (2, "qwen")], max_label_sets=2))
    bus.publish(event(EventType.MP_LOOKUP_START, md(num_tokens=16), "op1", 1.0))
    bus.publish(event(EventType.MP_LOOKUP_END, md(num_tokens=16, hit_tokens=0), "op1", 1.1))  # 1 newer
    bus.publish(event(EventType.MP_LOOKUP_END, md(3, "phi", num_tokens=16, hit_tokens=0), "op2", 2.0))
    # 3 is new and the cap is 2: 2, the least recently reported, goes
    assert bus.flush(5)
    v = registry.get_sample_value
    for name in ("kvcache_store_requests_total", "kvcache_lookup_duration_seconds_count"):
        assert v(name, I2) is None, name
        assert v(name, {"instance_id": "3", "model_name": "phi"}) == 0, name
    assert v("kvcache_lookup_requests_total", I1) == 1
