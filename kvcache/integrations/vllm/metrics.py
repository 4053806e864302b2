"""kvcache's statistics inside vLLM's own metrics: its log line and its ``/metrics``.

vLLM asks each connector half for a ``KVConnectorStats`` every step, merges them across
tensor-parallel workers and the scheduler, logs ``reduce()`` periodically and hands the merged
dict to the connector's ``KVConnectorPromMetrics.observe``. The accounting lives in
``stats.py`` (no vLLM import); this module only adapts it to vLLM's classes.

Metric names: where the meaning is the same as vLLM's own offloading connector, its names and
label set (``vllm:kv_offload_{load,store}_{bytes,time,size}``), so dashboards and alerts built
for it work unchanged; ``vllm:kvcache_*`` for what only kvcache reports. The table with the
daemon-side counterparts is in docs/vllm.md and METRICS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvcache.integrations.vllm.stats import HIT_SERIES, PROM_SERIES, SIZE_BUCKETS, Payload, merge, summarize


@dataclass
class KVCacheConnectorStats(KVConnectorStats):
    """vLLM's stats container around a ``stats.Payload`` (one interval, already a delta)."""

    def reset(self) -> None:
        self.data: Payload = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KVCachePromMetrics(KVConnectorPromMetrics):
    """Registers kvcache's series with vLLM's metric classes and feeds them each interval."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[tuple[int, str], Any] = {}
        self._kinds: dict[str, str] = {}
        for name, kind, doc, key in PROM_SERIES:
            if kind == "histogram":
                family = self._histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                             buckets=SIZE_BUCKETS)  # fmt: skip
            else:
                family = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._kinds[key] = kind
            for engine, values in per_engine_labelvalues.items():
                self._series[(engine, key)] = family.labels(*values)
        hit_name, hit_doc = HIT_SERIES
        hits = self._counter_cls(name=hit_name, documentation=hit_doc, labelnames=[*labelnames, "tier"])
        for engine, values in per_engine_labelvalues.items():
            for tier in ("L1", "L2"):
                self._series[(engine, f"lookup_hit_tokens_{tier.lower()}")] = hits.labels(*values, tier)
                self._kinds[f"lookup_hit_tokens_{tier.lower()}"] = "counter"

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            series = self._series.get((engine_idx, key))
            if series is None:  # a counter kept for the log line only (e.g. op counts)
                continue
            if self._kinds[key] == "histogram":
                for sample in value:
                    series.observe(sample)
            elif value:
                series.inc(value)


__all__ = ["KVCacheConnectorStats", "KVCachePromMetrics"]
