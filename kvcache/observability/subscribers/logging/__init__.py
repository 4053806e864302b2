"""Log lines through the standard ``logging`` module."""

from kvcache.observability.subscribers.logging.operations import LoggingSubscriber
from kvcache.observability.subscribers.logging.request_trace import RequestTraceSubscriber

__all__ = ["LoggingSubscriber", "RequestTraceSubscriber"]
