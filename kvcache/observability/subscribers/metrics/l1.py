"""Traffic, evictions, allocation failures and occupancy of the L1 (pinned CPU) pool.

Its own subscriber so L1 counters can be read or switched off apart from the engine's
operation metrics. L1 is shared by every engine instance, so these series carry no
``instance_id``/``model_name`` labels; they all exist at zero from construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import (
    Event,
    EventType,
    L1AllocationFailed,
    L1KeysEvicted,
    L1ReadFinished,
    L1WriteFinished,
)
from kvcache.observability.instruments import MetricSet


class L1MetricsSubscriber(EventSubscriber):
    """Counters and gauges from L1_* events; see METRICS.md."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        m = self.metrics = MetricSet()
        self._write_chunks = m.counter("kvcache_l1_write_chunks_total", "Chunks written to L1.")
        self._write_bytes = m.counter("kvcache_l1_write_bytes_total", "Bytes written to L1.")
        self._read_chunks = m.counter("kvcache_l1_read_chunks_total", "Chunks read from L1.")
        self._read_bytes = m.counter("kvcache_l1_read_bytes_total", "Bytes read from L1.")
        self._evicted_chunks = m.counter("kvcache_l1_evicted_chunks_total", "Chunks evicted from L1.")
        self._evicted_bytes = m.counter("kvcache_l1_evicted_bytes_total", "Bytes freed by L1 evictions.")
        self._alloc_failures = m.counter(
            "kvcache_l1_allocation_failures_total", "L1 allocations that found no memory."
        )
        self._alloc_failed_bytes = m.counter(
            "kvcache_l1_allocation_failed_bytes_total", "Bytes requested by failed allocations."
        )
        self._clears = m.counter("kvcache_l1_clears_total", "Times L1 was cleared.")
        self._used = m.gauge("kvcache_l1_used_bytes", "Bytes of L1 holding chunks.")
        self._capacity = m.gauge("kvcache_l1_capacity_bytes", "L1 capacity in bytes.")
        if registry is not None:
            m.register(registry)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.L1_WRITE_FINISHED: self._on_write,
            EventType.L1_READ_FINISHED: self._on_read,
            EventType.L1_KEYS_EVICTED: self._on_evict,
            EventType.L1_ALLOCATION_FAILED: self._on_alloc_failed,
            EventType.L1_CLEARED: self._on_cleared,
        }

    def _occupancy(self, md: L1WriteFinished | L1KeysEvicted | L1AllocationFailed) -> None:
        self._used.value = md.used_bytes
        self._capacity.value = md.capacity_bytes

    def _on_write(self, event: Event) -> None:
        md = cast(L1WriteFinished, event.metadata)
        self._write_chunks.value += len(md.keys)
        self._write_bytes.value += md.num_bytes
        self._occupancy(md)

    def _on_read(self, event: Event) -> None:
        md = cast(L1ReadFinished, event.metadata)
        self._read_chunks.value += len(md.keys)
        self._read_bytes.value += md.num_bytes

    def _on_evict(self, event: Event) -> None:
        md = cast(L1KeysEvicted, event.metadata)
        self._evicted_chunks.value += len(md.keys)
        self._evicted_bytes.value += md.num_bytes
        self._occupancy(md)

    def _on_alloc_failed(self, event: Event) -> None:
        md = cast(L1AllocationFailed, event.metadata)
        self._alloc_failures.value += 1
        self._alloc_failed_bytes.value += md.num_bytes
        self._occupancy(md)

    def _on_cleared(self, event: Event) -> None:
        self._clears.value += 1
        self._used.value = 0


__all__ = ["L1MetricsSubscriber"]
