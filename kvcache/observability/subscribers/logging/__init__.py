"""Log lines through the standard ``logging`` module."""

from kvcache.observability.subscribers.logging.operations import LoggingSubscriber

__all__ = ["LoggingSubscriber"]
