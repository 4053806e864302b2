"""Traffic, latency, failures and evictions of the L2 tiers (disk, Redis), per backend.

Its own subscriber because L2 is optional and its failure modes (corrupt chunk, timeout,
unavailable server) are what an operator watches for. Series are labelled ``backend``;
failure counters also ``reason``. All series of a backend are created together, at zero,
when the backend first reports (or up front via ``backends=``); a failure series appears
when its (backend, reason) first occurs.
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
    L2ChecksumFailed,
    L2KeysEvicted,
    L2LoadFailed,
    L2LoadFinished,
    L2Meta,
    L2StoreDeclined,
    L2StoreFailed,
    L2StoreFinished,
)
from kvcache.observability.instruments import Counter, MetricSet

_COUNTERS = (
    ("store_chunks", "kvcache_l2_store_chunks_total", "Chunks written to L2."),
    ("store_bytes", "kvcache_l2_store_bytes_total", "Bytes written to L2."),
    ("store_seconds", "kvcache_l2_store_seconds_total", "Seconds spent writing to L2."),
    ("load_chunks", "kvcache_l2_load_chunks_total", "Chunks read from L2."),
    ("load_bytes", "kvcache_l2_load_bytes_total", "Bytes read from L2."),
    ("load_seconds", "kvcache_l2_load_seconds_total", "Seconds spent reading from L2."),
    ("evicted_chunks", "kvcache_l2_evicted_chunks_total", "Chunks evicted from L2."),
    ("evicted_bytes", "kvcache_l2_evicted_bytes_total", "Bytes freed by L2 evictions."),
    ("clears", "kvcache_l2_clears_total", "Times an L2 backend was cleared."),
    ("declined_chunks", "kvcache_l2_declined_chunks_total", "Stored chunks admission kept off L2."),
    ("checksum_failures", "kvcache_l2_checksum_failures_total", "Chunks whose checksum failed (a miss)."),
    ("declined_bytes", "kvcache_l2_declined_bytes_total", "Bytes of stored chunks kept off L2 by admission."),
)


@dataclass(slots=True)
class _BackendSeries:
    counters: dict[str, Counter]


class L2MetricsSubscriber(EventSubscriber):
    """Counters from L2_* events; see METRICS.md."""

    def __init__(self, registry: CollectorRegistry | None, backends: Iterable[str] = ()) -> None:
        m = self.metrics = MetricSet()
        self._families = {attr: m.add(name, doc, "counter", ("backend",)) for attr, name, doc in _COUNTERS}
        self._store_failures = m.add(
            "kvcache_l2_store_failures_total",
            "L2 writes that failed.",
            "counter",
            ("backend", "reason"),
        )
        self._load_failures = m.add(
            "kvcache_l2_load_failures_total",
            "L2 reads that failed (the chunk counts as a miss).",
            "counter",
            ("backend", "reason"),
        )
        self._series: dict[object, _BackendSeries] = {}
        for backend in backends:
            self._backend(backend)
        if registry is not None:
            m.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.L2_STORE_FINISHED: self._on_store,
            EventType.L2_STORE_FAILED: self._on_store_failed,
            EventType.L2_STORE_DECLINED: self._on_declined,
            EventType.L2_CHECKSUM_FAILED: self._on_checksum,
            EventType.L2_LOAD_FINISHED: self._on_load,
            EventType.L2_LOAD_FAILED: self._on_load_failed,
            EventType.L2_KEYS_EVICTED: self._on_evict,
            EventType.L2_CLEARED: self._on_cleared,
        }

    def _backend(self, backend: object) -> dict[str, Counter]:
        series = self._series.get(backend)
        if series is None:
            name = str(backend)
            series = _BackendSeries({a: f.counter(name) for a, f in self._families.items()})
            self._series[backend] = series
        return series.counters

    def _on_store(self, event: Event) -> None:
        md = cast(L2StoreFinished, event.metadata)
        c = self._backend(md.backend)
        c["store_chunks"].value += len(md.keys)
        c["store_bytes"].value += md.num_bytes
        c["store_seconds"].value += md.duration_s

    def _on_declined(self, event: Event) -> None:
        md = cast(L2StoreDeclined, event.metadata)
        c = self._backend(md.backend)
        c["declined_chunks"].value += len(md.keys)
        c["declined_bytes"].value += md.num_bytes

    def _on_checksum(self, event: Event) -> None:
        md = cast(L2ChecksumFailed, event.metadata)
        self._backend(md.backend)["checksum_failures"].value += len(md.keys)

    def _on_load(self, event: Event) -> None:
        md = cast(L2LoadFinished, event.metadata)
        c = self._backend(md.backend)
        c["load_chunks"].value += len(md.keys)
        c["load_bytes"].value += md.num_bytes
        c["load_seconds"].value += md.duration_s

    def _on_store_failed(self, event: Event) -> None:
        md = cast(L2StoreFailed, event.metadata)
        self._backend(md.backend)
        self._store_failures.counter(md.backend, md.reason).value += 1

    def _on_load_failed(self, event: Event) -> None:
        md = cast(L2LoadFailed, event.metadata)
        self._backend(md.backend)
        self._load_failures.counter(md.backend, md.reason).value += 1

    def _on_evict(self, event: Event) -> None:
        md = cast(L2KeysEvicted, event.metadata)
        c = self._backend(md.backend)
        c["evicted_chunks"].value += len(md.keys)
        c["evicted_bytes"].value += md.num_bytes

    def _on_cleared(self, event: Event) -> None:
        self._backend(cast(L2Meta, event.metadata).backend)["clears"].value += 1


__all__ = ["L2MetricsSubscriber"]
