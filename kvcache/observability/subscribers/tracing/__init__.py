"""OpenTelemetry spans (OpenTelemetry is imported only when a subscriber is built)."""

from kvcache.observability.subscribers.tracing.operations import SPAN_NAMES, TracingSubscriber

__all__ = ["SPAN_NAMES", "TracingSubscriber"]
