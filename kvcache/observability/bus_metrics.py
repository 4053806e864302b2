"""The event bus's own metrics: queue depth and bound, accepted, dispatched and dropped
events, subscriber errors and dispatch lag.

Separate from ``bus.py`` so the bus module stays about queueing and dispatch. The bus keeps
plain ints on its hot path; this collector reads a snapshot of them at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvcache.observability.event import EventType
from kvcache.observability.instruments import LAG_SECONDS, MetricSet


class BusSnapshot(NamedTuple):
    depth: int
    published: int
    dispatched: int
    dropped: dict[str, int]  # by EventType value
    errors: dict[str, int]  # by subscriber name


class BusMetrics:
    """``kvcache_event_bus_*`` families; ``lag`` is observed by the dispatcher directly."""

    def __init__(self, capacity: int, snapshot: Callable[[], BusSnapshot]) -> None:
        m = self.metrics = MetricSet()
        depth = m.gauge("kvcache_event_bus_queue_depth", "Events waiting for dispatch.")
        m.gauge("kvcache_event_bus_queue_capacity", "Queue bound; publishes beyond it are dropped.").set(
            capacity
        )
        published = m.counter("kvcache_event_bus_published_events_total", "Events accepted into the queue.")
        dispatched = m.counter("kvcache_event_bus_dispatched_events_total", "Events handed to subscribers.")
        dropped = m.add(
            "kvcache_event_bus_dropped_events_total",
            "Events dropped because the queue was full.",
            "counter",
            ("event_type",),
        )
        errors = m.add(
            "kvcache_event_bus_subscriber_errors_total",
            "Subscriber callbacks that raised.",
            "counter",
            ("subscriber",),
        )
        self.lag = m.histogram(
            "kvcache_event_bus_dispatch_lag_seconds",
            "Time a dispatched event waited in the queue (sampled).",
            LAG_SECONDS,
        )
        for event_type in EventType:
            dropped.labels(event_type.value)

        def refresh() -> None:
            snap = snapshot()
            depth.set(snap.depth)
            published.value = snap.published
            dispatched.value = snap.dispatched
            for value, n in snap.dropped.items():
                dropped.counter(value).value = n
            for name, n in snap.errors.items():
                errors.counter(name).value = n

        m.on_collect(refresh)


__all__ = ["BusMetrics", "BusSnapshot"]
