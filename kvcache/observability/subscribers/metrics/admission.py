"""What the daemon refused, per principal: ``kvcache_requests_refused_total{principal,limit}``;
and the replies it could not deliver: ``kvcache_replies_dropped_total{reason}``.

Its own subscriber because it answers the operator's fair-share question, "who is being held
to a bound, and which one", apart from what the engine did with the requests it took. Counted
from ``REQUEST_REFUSED``, published by the daemon wherever a per-principal bound refuses a
request (``server.budget``). Principals are the daemon's own user, plain loopback TCP, or a
listed CURVE client, so the label's values are bounded by the clients file; a cap
(``MAX_PRINCIPAL_LABEL_SETS``) still retires the least recently refused ones. Dropped replies
(``REPLY_DROPPED``, ``server.delivery``) answer the same operator from the other side: a
client that asks faster than it reads, or leaves before its answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, ReplyDropped, RequestRefused
from kvcache.observability.instruments import LabelSetCap, MetricSet

MAX_PRINCIPAL_LABEL_SETS = 1024
"""(principal, limit) series exposed at once; the least recently refused go first."""


class AdmissionMetricsSubscriber(EventSubscriber):
    """Counts each refused request under its sender and the bound that refused it."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.metrics = MetricSet()
        self._refused = self.metrics.add(
            "kvcache_requests_refused_total",
            "Requests refused (LIMIT) because their sender was at a per-principal bound "
            "(the limit label names its flag); the client should back off.",
            "counter",
            ("principal", "limit"),
        )
        self._dropped = self.metrics.add(
            "kvcache_replies_dropped_total",
            "Replies the daemon could not deliver: reason unread (the client's queue of unread "
            "replies was full) or gone (its connection had closed).",
            "counter",
            ("reason",),
        )
        self._cap = LabelSetCap(MAX_PRINCIPAL_LABEL_SETS)
        if registry is not None:
            self.metrics.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.REQUEST_REFUSED: self._on_refused, EventType.REPLY_DROPPED: self._on_dropped}

    def _on_refused(self, event: Event) -> None:
        md = cast(RequestRefused, event.metadata)
        gone = self._cap.touch((md.principal, md.limit))
        if gone is not None:
            self._refused.remove(str(gone[0]), str(gone[1]))
        self._refused.counter(md.principal, md.limit).inc(md.count)

    def _on_dropped(self, event: Event) -> None:
        md = cast(ReplyDropped, event.metadata)
        self._dropped.counter(md.reason).inc(md.count)


__all__ = ["MAX_PRINCIPAL_LABEL_SETS", "AdmissionMetricsSubscriber"]
