"""Prometheus counters and latency histograms for the engine's store, retrieve and lookup.

Its own subscriber (not merged with L1/L2 or transfer metrics) so each concern can be
switched and read on its own. Every series carries ``instance_id`` and ``model_name``; all
series of one (instance_id, model_name) pair are created together, at zero, the first time
that pair publishes (or up front through ``instances=``), so ``rate()`` works from the
first scrape after.

Operation latency is measured from the START event's timestamp to the END event's, paired
by (session_id, instance_id, device, operation): tensor-parallel workers share request ids,
so the session alone would pair one worker's start with another's end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import (
    Event,
    EventType,
    MpLookupEnd,
    MpRetrieveEnd,
    MpStoreEnd,
    OperationMeta,
)
from kvcache.observability.instruments import (
    MAX_INSTANCE_LABEL_SETS,
    OPERATION_SECONDS,
    Counter,
    Family,
    Histogram,
    LabelSetCap,
    MetricSet,
)

LABELS = ("instance_id", "model_name")
_MAX_OPEN_OPERATIONS = 65_536  # starts whose end never came are forgotten beyond this

# (attribute, metric name, help) for every counter, per operation.
_STORE = (
    ("requests", "kvcache_store_requests_total", "Store operations finished."),
    ("failures", "kvcache_store_failures_total", "Store operations that reported failure."),
    ("requested_tokens", "kvcache_store_requested_tokens_total", "Tokens offered to store."),
    ("stored_tokens", "kvcache_store_stored_tokens_total", "Tokens newly written to L1."),
    ("stored_chunks", "kvcache_store_stored_chunks_total", "Chunks newly written to L1."),
    ("skipped_chunks", "kvcache_store_skipped_chunks_total", "Chunks already held, not copied."),
    ("failed_chunks", "kvcache_store_failed_chunks_total", "Chunks not stored (memory/error)."),
)
_RETRIEVE = (
    ("requests", "kvcache_retrieve_requests_total", "Retrieve operations finished."),
    ("failures", "kvcache_retrieve_failures_total", "Retrieve operations that reported failure."),
    ("requested_tokens", "kvcache_retrieve_requested_tokens_total", "Tokens asked for."),
    (
        "retrieved_tokens",
        "kvcache_retrieve_retrieved_tokens_total",
        "Prefix tokens valid in the engine afterwards (skipped + copied).",
    ),
    (
        "skipped_tokens",
        "kvcache_retrieve_skipped_tokens_total",
        "Tokens the engine already held and were not copied.",
    ),
    ("l1_tokens", "kvcache_retrieve_l1_tokens_total", "Copied tokens that were in L1."),
    ("l2_tokens", "kvcache_retrieve_l2_tokens_total", "Copied tokens brought up from L2."),
    ("missing_tokens", "kvcache_retrieve_missing_tokens_total", "Requested tokens not found."),
    (
        "awaited_missing_tokens",
        "kvcache_retrieve_awaited_missing_tokens_total",
        "Tokens another engine was storing that did not arrive by the retrieve's wait bound.",
    ),
)
_LOOKUP = (
    ("requests", "kvcache_lookup_requests_total", "Lookup operations finished."),
    ("requested_tokens", "kvcache_lookup_requested_tokens_total", "Tokens looked up."),
    ("hit_tokens", "kvcache_lookup_hit_tokens_total", "Leading tokens found in L1 or L2."),
    ("l1_hit_tokens", "kvcache_lookup_l1_hit_tokens_total", "Hit tokens found in L1."),
    ("l2_hit_tokens", "kvcache_lookup_l2_hit_tokens_total", "Hit tokens found only in L2."),
)
_OPERATIONS = {"store": _STORE, "retrieve": _RETRIEVE, "lookup": _LOOKUP}


@dataclass(slots=True)
class _OperationSeries:
    counters: dict[str, Counter]
    duration: Histogram


class EngineMetricsSubscriber(EventSubscriber):
    """Counts MP_STORE/RETRIEVE/LOOKUP_{START,END}; see METRICS.md for every series."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        instances: Iterable[tuple[int, str]] = (),
        max_label_sets: int = MAX_INSTANCE_LABEL_SETS,
    ) -> None:
        """``max_label_sets``: (instance_id, model_name) pairs exposed at once
        (``instruments.LabelSetCap``)."""
        self.metrics = MetricSet()
        self._counter_families: dict[str, dict[str, Family]] = {}
        self._duration_families: dict[str, Family] = {}
        for op, spec in _OPERATIONS.items():
            self._counter_families[op] = {
                attr: self.metrics.add(name, doc, "counter", LABELS) for attr, name, doc in spec
            }
            self._duration_families[op] = self.metrics.add(
                f"kvcache_{op}_duration_seconds",
                f"{op.capitalize()} latency, START to END event of one operation.",
                "histogram",
                LABELS,
                OPERATION_SECONDS,
            )
        self._series: dict[tuple[str, object, object], _OperationSeries] = {}
        self._label_sets = LabelSetCap(max_label_sets)
        self._open: dict[tuple[str, object, str, str], float] = {}
        for instance_id, model_name in instances:
            self._ensure_instance(instance_id, model_name)
        if registry is not None:
            self.metrics.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.MP_STORE_START: self._on_store_start,
            EventType.MP_RETRIEVE_START: self._on_retrieve_start,
            EventType.MP_LOOKUP_START: self._on_lookup_start,
            EventType.MP_STORE_END: self._on_store_end,
            EventType.MP_RETRIEVE_END: self._on_retrieve_end,
            EventType.MP_LOOKUP_END: self._on_lookup_end,
        }

    def _ensure_instance(self, instance_id: object, model_name: object) -> None:
        values = (str(instance_id), str(model_name))
        dropped = self._label_sets.touch((instance_id, model_name))
        if dropped is not None:  # more label sets than the cap: the least recently reported goes
            for op in _OPERATIONS:
                del self._series[(op, dropped[0], dropped[1])]
                for family in (*self._counter_families[op].values(), self._duration_families[op]):
                    family.remove(*map(str, dropped))
        for op in _OPERATIONS:
            self._series[(op, instance_id, model_name)] = _OperationSeries(
                {a: f.counter(*values) for a, f in self._counter_families[op].items()},
                self._duration_families[op].histogram(*values),
            )

    def _get(self, op: str, md: OperationMeta) -> _OperationSeries:
        key = (op, md.instance_id, md.model_name)
        series = self._series.get(key)
        if series is None:
            self._ensure_instance(key[1], key[2])
            series = self._series[key]
        else:
            self._label_sets.touch((key[1], key[2]))
        return series

    @staticmethod
    def _op_key(op: str, event: Event) -> tuple[str, object, str, str]:
        md = cast(OperationMeta, event.metadata)
        return (event.session_id, md.instance_id, md.device, op)

    def _start(self, op: str, event: Event) -> None:
        assert event.timestamp is not None
        self._open[self._op_key(op, event)] = event.timestamp
        if len(self._open) > _MAX_OPEN_OPERATIONS:
            del self._open[next(iter(self._open))]  # oldest start whose END never came

    def _on_store_start(self, event: Event) -> None:
        self._start("store", event)

    def _on_retrieve_start(self, event: Event) -> None:
        self._start("retrieve", event)

    def _on_lookup_start(self, event: Event) -> None:
        self._start("lookup", event)

    def _observe_duration(self, op: str, event: Event, series: _OperationSeries) -> None:
        started = self._open.pop(self._op_key(op, event), None)
        if started is not None and event.timestamp is not None:
            series.duration.observe(max(0.0, event.timestamp - started))

    def _on_store_end(self, event: Event) -> None:
        md = cast(MpStoreEnd, event.metadata)
        s = self._get("store", md)
        c = s.counters
        c["requests"].value += 1
        if not md.success:
            c["failures"].value += 1
        c["requested_tokens"].value += md.num_tokens
        c["stored_tokens"].value += md.stored_tokens
        c["stored_chunks"].value += md.stored_chunks
        c["skipped_chunks"].value += md.skipped_chunks
        c["failed_chunks"].value += md.failed_chunks
        self._observe_duration("store", event, s)

    def _on_retrieve_end(self, event: Event) -> None:
        md = cast(MpRetrieveEnd, event.metadata)
        s = self._get("retrieve", md)
        c = s.counters
        c["requests"].value += 1
        if not md.success:
            c["failures"].value += 1
        c["requested_tokens"].value += md.num_tokens
        c["retrieved_tokens"].value += md.retrieved_tokens
        c["skipped_tokens"].value += md.skip_tokens
        c["l1_tokens"].value += md.l1_tokens
        c["l2_tokens"].value += md.l2_tokens
        c["missing_tokens"].value += md.missing_tokens
        c["awaited_missing_tokens"].value += md.awaited_missing_tokens
        self._observe_duration("retrieve", event, s)

    def _on_lookup_end(self, event: Event) -> None:
        md = cast(MpLookupEnd, event.metadata)
        s = self._get("lookup", md)
        c = s.counters
        c["requests"].value += 1
        c["requested_tokens"].value += md.num_tokens
        c["hit_tokens"].value += md.hit_tokens
        c["l1_hit_tokens"].value += md.l1_hit_tokens
        c["l2_hit_tokens"].value += md.l2_hit_tokens
        self._observe_duration("lookup", event, s)


__all__ = ["EngineMetricsSubscriber"]
