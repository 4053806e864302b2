"""kvcache_tokens_served_total: per-tier token counts from retrieve ends, read from the registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.metrics.tiers import TIERS, TierMetricsSubscriber
from tests.helpers import event


def served(reg: CollectorRegistry, tier: str, model: str = "m", inst: str = "0") -> float | None:
    return reg.get_sample_value(
        "kvcache_tokens_served_total", {"tier": tier, "model_name": model, "instance_id": inst}
    )


def test_retrieves_add_per_tier_and_lookups_do_not() -> None:
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    bus.register_subscriber(TierMetricsSubscriber(reg))
    with bus:
        meta = {"instance_id": 0, "model_name": "m", "device": "cpu", "num_tokens": 1024}
        bus.publish(
            event(
                EventType.MP_RETRIEVE_END,
                {**meta, "skip_tokens": 256, "l1_tokens": 512, "l2_tokens": 128, "missing_tokens": 128},
            )
        )
        bus.publish(
            event(
                EventType.MP_RETRIEVE_END,
                {**meta, "skip_tokens": 0, "l1_tokens": 0, "l2_tokens": 256, "missing_tokens": 768},
            )
        )
        bus.publish(
            event(
                EventType.MP_LOOKUP_END, {**meta, "hit_tokens": 512, "l1_hit_tokens": 512, "l2_hit_tokens": 0}
            )
        )
        bus.publish(
            event(
                EventType.MP_RETRIEVE_END,
                {
                    **meta,
                    "instance_id": 1,
                    "skip_tokens": 0,
                    "l1_tokens": 0,
                    "l2_tokens": 0,
                    "missing_tokens": 0,
                },
            )
        )
        assert bus.flush(5)
    assert [served(reg, t) for t in TIERS] == [256, 512, 384, 896]
    assert sum(served(reg, t) or 0 for t in TIERS) == 2048  # the tiers add up to the requests
    assert [served(reg, t, inst="1") for t in TIERS] == [0, 0, 0, 0]  # all series exist at 0
    assert served(reg, "l1", model="other") is None
