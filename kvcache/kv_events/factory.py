"""Picking a KV-event publisher by name: ``null``, ``zmq``, or one a framework registers.

Apart from ``publisher`` (the contract) so that the contract imports no implementation; the
registry refuses a name given twice and names the known ones when asked for an unknown one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcache.kv_events.publisher import EventPublisher, NullEventPublisher
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher

PublisherCtor = Callable[..., EventPublisher]


class EventPublisherFactory:
    """Name -> publisher constructor. ``create(None)`` and ``create("null")`` give the null one."""

    def __init__(self) -> None:
        self._registry: dict[str, PublisherCtor] = {}

    def register(self, name: str, ctor: PublisherCtor) -> None:
        if name in self._registry:
            raise ValueError(f"KV event publisher {name!r} is already registered")
        self._registry[name] = ctor

    def names(self) -> list[str]:
        return sorted(self._registry)

    def create(self, kind: str | None, **kwargs: Any) -> EventPublisher:
        if kind is None:
            return NullEventPublisher()
        try:
            ctor = self._registry[kind]
        except KeyError:
            raise ValueError(
                f"unknown KV event publisher {kind!r} (known: {', '.join(self.names())})"
            ) from None
        return ctor(**kwargs)


def default_factory() -> EventPublisherFactory:
    """A factory knowing ``null`` and ``zmq``; callers may register more on their own copy."""
    factory = EventPublisherFactory()
    factory.register("null", NullEventPublisher)
    factory.register("zmq", ZmqEventPublisher)
    return factory


__all__ = ["EventPublisherFactory", "PublisherCtor", "default_factory"]
