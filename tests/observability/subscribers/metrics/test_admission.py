"""``kvcache_requests_refused_total``: every refused request counted, however the daemon batched
the events (``server.refusals``: one ``REQUEST_REFUSED`` per principal and bound per turn)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.metrics import AdmissionMetricsSubscriber
from tests.helpers import event

FLAG = "--max-awaiting-retrieves"


def test_a_batched_refusal_event_counts_each_request(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(AdmissionMetricsSubscriber(registry))
    bus.publish(event(EventType.REQUEST_REFUSED, {"principal": "loopback", "limit": FLAG,
                                                  "request": "retrieve", "count": 17952}))  # fmt: skip
    bus.publish(event(EventType.REQUEST_REFUSED, {"principal": "loopback", "limit": FLAG,
                                                  "request": "retrieve"}))  # fmt: skip  # count 1
    assert bus.flush(5)
    value = registry.get_sample_value(
        "kvcache_requests_refused_total", {"principal": "loopback", "limit": FLAG}
    )
    assert value == 17953


def test_dropped_replies_are_counted_by_reason(bus: EventBus, registry: CollectorRegistry) -> None:
    bus.register_subscriber(AdmissionMetricsSubscriber(registry))
    bus.publish(event(EventType.REPLY_DROPPED, {"reason": "unread", "count": 1200}))
    bus.publish(event(EventType.REPLY_DROPPED, {"reason": "gone"}))
    assert bus.flush(5)
    assert registry.get_sample_value("kvcache_replies_dropped_total", {"reason": "unread"}) == 1200
    assert registry.get_sample_value("kvcache_replies_dropped_total", {"reason": "gone"}) == 1
