"""Transfer metrics between the engine's KV cache and kvcache's chunks, named after vLLM's.

vLLM's offloading connector reports, per direction, bytes moved, seconds spent and a
transfer-size histogram; mirroring those under ``kvcache_offload_`` lets one dashboard
serve both. ``store`` is engine -> cache (MP_STORE_END), ``load`` is cache -> engine
(MP_RETRIEVE_END), both from the END event's ``num_bytes`` and ``transfer_seconds``, which
the engine sums from its copies' ``TransferResult`` records (as it does for
``CacheEngine.stats_snapshot``): one source, so the two views never disagree.

Average throughput is Σ bytes / Σ seconds (``rate(..._bytes_total) /
rate(..._seconds_total)``), never the mean of per-transfer rates; the per-transfer
throughput histogram (bytes/s, buckets from 0.1 to 200 GB/s) is for the distribution.
Transfers of zero bytes (everything already present) add nothing to the histograms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, MpRetrieveEnd, MpStoreEnd
from kvcache.observability.instruments import (
    MAX_INSTANCE_LABEL_SETS,
    THROUGHPUT_BYTES_PER_SECOND,
    TRANSFER_BYTES,
    Counter,
    Family,
    Histogram,
    LabelSetCap,
    MetricSet,
)

LABELS = ("instance_id", "model_name")


@dataclass(slots=True)
class _DirectionSeries:
    nbytes: Counter
    seconds: Counter
    size: Histogram
    throughput: Histogram


class OffloadMetricsSubscriber(EventSubscriber):
    """Bytes, seconds, size and throughput of every engine <-> cache transfer."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        instances: Iterable[tuple[int, str]] = (),
        max_label_sets: int = MAX_INSTANCE_LABEL_SETS,
    ) -> None:
        """``max_label_sets``: (instance_id, model_name) pairs exposed at once
        (``instruments.LabelSetCap``)."""
        self.metrics = MetricSet()
        self._families: dict[str, tuple[Family, Family, Family, Family]] = {}
        for direction, what in (("store", "engine to cache"), ("load", "cache to engine")):
            p = f"kvcache_offload_{direction}"
            self._families[direction] = (
                self.metrics.add(f"{p}_bytes_total", f"Bytes copied {what}.", "counter", LABELS),
                self.metrics.add(f"{p}_seconds_total", f"Seconds spent copying {what}.", "counter", LABELS),
                self.metrics.add(
                    f"{p}_size_bytes",
                    f"Bytes per transfer, {what}.",
                    "histogram",
                    LABELS,
                    TRANSFER_BYTES,
                ),
                self.metrics.add(
                    f"{p}_throughput_bytes_per_second",
                    f"Per-transfer throughput {what} (buckets 0.1 to 200 GB/s).",
                    "histogram",
                    LABELS,
                    THROUGHPUT_BYTES_PER_SECOND,
                ),
            )
        self._series: dict[tuple[str, object, object], _DirectionSeries] = {}
        self._label_sets = LabelSetCap(max_label_sets)
        for instance_id, model_name in instances:
            self._ensure_instance(instance_id, model_name)
        if registry is not None:
            self.metrics.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.MP_STORE_END: self._on_store_end,
            EventType.MP_RETRIEVE_END: self._on_retrieve_end,
        }

    def _ensure_instance(self, instance_id: object, model_name: object) -> None:
        values = (str(instance_id), str(model_name))
        dropped = self._label_sets.touch((instance_id, model_name))
        if dropped is not None:  # more label sets than the cap: the least recently reported goes
            for direction, families in self._families.items():
                del self._series[(direction, dropped[0], dropped[1])]
                for family in families:
                    family.remove(*map(str, dropped))
        for direction, (nbytes, seconds, size, throughput) in self._families.items():
            self._series[(direction, instance_id, model_name)] = _DirectionSeries(
                nbytes.counter(*values),
                seconds.counter(*values),
                size.histogram(*values),
                throughput.histogram(*values),
            )

    def _record(self, direction: str, event: Event) -> None:
        md = cast(MpStoreEnd | MpRetrieveEnd, event.metadata)
        key = (direction, md.instance_id, md.model_name)
        s = self._series.get(key)
        if s is None:
            self._ensure_instance(key[1], key[2])
            s = self._series[key]
        else:
            self._label_sets.touch((key[1], key[2]))
        nbytes = md.num_bytes
        seconds = md.transfer_seconds
        s.nbytes.value += nbytes
        s.seconds.value += seconds
        if nbytes > 0:
            s.size.observe(nbytes)
            if seconds > 0:
                s.throughput.observe(nbytes / seconds)

    def _on_store_end(self, event: Event) -> None:
        self._record("store", event)

    def _on_retrieve_end(self, event: Event) -> None:
        self._record("load", event)


__all__ = ["OffloadMetricsSubscriber"]
