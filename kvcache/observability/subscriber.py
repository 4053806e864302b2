"""``EventSubscriber``: the contract between the event bus and whatever consumes events.

Its own module so that subscribers can be written against the contract without the bus's
queue and thread; ``kvcache.observability.bus`` re-exports both names, so plug-ins keep
importing them from there. The null bus (``event.NullEventBus``) takes subscribers and drops
them, so it needs no import of this module.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping

from kvcache.observability.event import Event, EventType

Callback = Callable[[Event], None]
"""What a subscriber registers per event type: called with each event on the dispatcher thread."""


class EventSubscriber(abc.ABC):
    """Turns events into something an operator can use; called only on the dispatcher thread.

    ``subscriptions`` is read once, at registration: it maps each event type the subscriber
    wants to the callback that handles it, so the bus never calls a subscriber for types it
    does not handle. Callbacks must not block for long (they delay every other subscriber);
    an exception is counted and logged by the bus and never reaches the publisher.
    ``shutdown`` runs once, on the thread that calls ``EventBus.stop``, after the last
    event was dispatched.
    """

    @property
    def name(self) -> str:
        """Label used in ``kvcache_event_bus_subscriber_errors_total{subscriber=...}``."""
        return type(self).__name__

    @abc.abstractmethod
    def subscriptions(self) -> Mapping[EventType, Callback]: ...

    def shutdown(self) -> None:  # optional hook
        return None


__all__ = ["Callback", "EventSubscriber"]
