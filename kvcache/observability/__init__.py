"""Observability: events, the event bus, and the subscribers that turn events into metrics,
lifecycle histograms, logs and traces.

The data path imports only ``event`` (``Event``, ``EventType``, ``EventSink``) and calls
``publish``; entry points call ``init_observability``. See EVENTS.md and METRICS.md.
Importing this package needs neither OpenTelemetry nor the native module, and its names load
on first use: a publisher that imports only the vocabulary (``event``) pulls in neither the bus,
nor prometheus_client, nor the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real names for type checkers; at run time they load on first use
    from kvcache.observability.bus import EventBus
    from kvcache.observability.config import ObservabilityConfig, add_observability_args
    from kvcache.observability.event import (
        BlockAllocationRecord,
        ChunkKey,
        Event,
        EventSink,
        EventType,
        NullEventBus,
    )
    from kvcache.observability.prometheus import PrometheusEndpoint, start_prometheus_endpoint
    from kvcache.observability.runtime import Observability, init_observability
    from kvcache.observability.subscriber import EventSubscriber

_HOME = {
    "EventBus": "bus",
    "EventSubscriber": "subscriber",
    "ObservabilityConfig": "config",
    "add_observability_args": "config",
    "BlockAllocationRecord": "event",
    "ChunkKey": "event",
    "Event": "event",
    "EventSink": "event",
    "EventType": "event",
    "NullEventBus": "event",
    "PrometheusEndpoint": "prometheus",
    "start_prometheus_endpoint": "prometheus",
    "Observability": "runtime",
    "init_observability": "runtime",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvcache.observability.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BlockAllocationRecord",
    "ChunkKey",
    "Event",
    "EventBus",
    "EventSink",
    "EventSubscriber",
    "EventType",
    "NullEventBus",
    "Observability",
    "ObservabilityConfig",
    "PrometheusEndpoint",
    "add_observability_args",
    "init_observability",
    "start_prometheus_endpoint",
]
