"""Event subscribers, one concern per package and one component per module.

Importing this package imports no optional dependency; ``TracingSubscriber`` pulls in
OpenTelemetry only when constructed.
"""

from kvcache.observability.subscribers.lifecycle import L0LifecycleSubscriber, L1LifecycleSubscriber
from kvcache.observability.subscribers.logging import LoggingSubscriber, RequestTraceSubscriber
from kvcache.observability.subscribers.metrics import (
    AdmissionMetricsSubscriber,
    EngineMetricsSubscriber,
    L1MetricsSubscriber,
    L2MetricsSubscriber,
    OffloadMetricsSubscriber,
    TierMetricsSubscriber,
)
from kvcache.observability.subscribers.tracing import TracingSubscriber

__all__ = [
    "AdmissionMetricsSubscriber",
    "EngineMetricsSubscriber",
    "L0LifecycleSubscriber",
    "L1LifecycleSubscriber",
    "L1MetricsSubscriber",
    "L2MetricsSubscriber",
    "LoggingSubscriber",
    "OffloadMetricsSubscriber",
    "RequestTraceSubscriber",
    "TierMetricsSubscriber",
    "TracingSubscriber",
]
