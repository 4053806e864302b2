"""Shared test helpers (tests are a package: ``from tests.helpers import RecordingSink``)."""

from __future__ import annotations

import threading

from kvcache.observability.event import Event, EventType


class RecordingSink:
    """An EventSink that keeps every event, for asserting on what the data path published.

    Thread-safe: L2 completions publish from I/O threads.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def publish(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, etype: EventType) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.event_type is etype]
