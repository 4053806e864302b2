"""``DisabledEventBus``: the event bus when observability is switched off.

A null object rather than ``if enabled:`` checks in callers, so the data path and entry
points handle "off" exactly like "on". Its own module to keep ``bus.py`` about the real bus;
``kvcache.observability.bus`` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.observability.event import Event

if TYPE_CHECKING:
    from kvcache.observability.subscriber import EventSubscriber


class DisabledEventBus:
    """The bus when observability is off: ``publish`` costs one call, nothing else runs."""

    enabled = False
    max_queue_size = 0
    running = False
    queue_depth = 0
    dropped_events = 0
    dispatched_events = 0
    subscribers: tuple[EventSubscriber, ...] = ()

    def publish(self, event: Event) -> None:
        return None

    def register_subscriber(self, subscriber: EventSubscriber) -> None:
        return None

    def start(self) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def stop(self, timeout: float | None = 10.0) -> None:
        return None

    def subscriber_errors(self, name: str) -> int:
        return 0

    def __enter__(self) -> DisabledEventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["DisabledEventBus"]
