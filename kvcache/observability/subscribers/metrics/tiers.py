"""Where served tokens came from: ``kvcache_tokens_served_total{tier=engine|l1|l2|miss}``.

Its own subscriber (not folded into the engine metrics) because it answers one operator
question, "which tier served this prompt's tokens", in one counter whose ``tier`` label sums
to the tokens requested, so a hit rate per tier is a single PromQL ratio.

Counted from ``MP_RETRIEVE_END`` only (a lookup predicts, a retrieve serves; counting both
would count one request twice): ``engine`` = ``skip_tokens`` (already in the engine's own
cache), ``l1`` = ``l1_tokens``, ``l2`` = ``l2_tokens``, ``miss`` = ``missing_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, MpRetrieveEnd
from kvcache.observability.instruments import Counter, MetricSet

TIERS = ("engine", "l1", "l2", "miss")
_SOURCES = (("engine", "skip_tokens"), ("l1", "l1_tokens"), ("l2", "l2_tokens"), ("miss", "missing_tokens"))


class TierMetricsSubscriber(EventSubscriber):
    """Adds each retrieve's per-tier token counts; every tier's series starts at 0 together."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.metrics = MetricSet()
        self._family = self.metrics.add(
            "kvcache_tokens_served_total",
            "Tokens of retrieved prompts by where they came from: the engine's own cache, L1, L2, "
            "or nowhere (miss).",
            "counter",
            ("tier", "model_name", "instance_id"),
        )
        self._series: dict[tuple[object, object], tuple[Counter, ...]] = {}
        if registry is not None:
            self.metrics.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_RETRIEVE_END: self._on_retrieve_end}

    def _counters(self, model_name: object, instance_id: object) -> tuple[Counter, ...]:
        key = (model_name, instance_id)
        counters = self._series.get(key)
        if counters is None:
            counters = tuple(self._family.counter(t, str(model_name), str(instance_id)) for t in TIERS)
            self._series[key] = counters
        return counters

    def _on_retrieve_end(self, event: Event) -> None:
        md = cast(MpRetrieveEnd, event.metadata)
        engine, l1, l2, miss = self._counters(md.model_name, md.instance_id)
        engine.value += md.skip_tokens
        l1.value += md.l1_tokens
        l2.value += md.l2_tokens
        miss.value += md.missing_tokens


__all__ = ["TIERS", "TierMetricsSubscriber"]
