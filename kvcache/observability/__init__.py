"""Observability: events, the event bus, and the subscribers that turn events into metrics,
lifecycle histograms, logs and traces.

The data path imports only ``event`` (``Event``, ``EventType``, ``EventSink``) and calls
``publish``; entry points call ``init_observability``. See EVENTS.md and METRICS.md.
Importing this package needs neither OpenTelemetry nor the native module.
"""

from kvcache.observability.bus import DisabledEventBus, EventBus, EventSubscriber
from kvcache.observability.config import ObservabilityConfig, add_observability_args
from kvcache.observability.event import (
    BlockAllocationRecord,
    ChunkKey,
    Event,
    EventSink,
    EventType,
    NullEventSink,
)
from kvcache.observability.prometheus import PrometheusEndpoint, start_prometheus_endpoint
from kvcache.observability.runtime import Observability, init_observability
from kvcache.observability.stream import AnchoredClock, publish_on_stream

__all__ = [
    "AnchoredClock",
    "BlockAllocationRecord",
    "ChunkKey",
    "DisabledEventBus",
    "Event",
    "EventBus",
    "EventSink",
    "EventSubscriber",
    "EventType",
    "NullEventSink",
    "Observability",
    "ObservabilityConfig",
    "PrometheusEndpoint",
    "add_observability_args",
    "init_observability",
    "publish_on_stream",
    "start_prometheus_endpoint",
]
