"""Shared test helpers (tests are a package: ``from tests.helpers import RecordingSink``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvcache.observability.event import Event, EventType
from kvcache.server.launch import DaemonProcess


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


def daemon_starter(base_args: list[str]) -> Iterator[Callable[..., DaemonProcess]]:
    """Body of a ``start_daemon`` fixture: starts ``python -m kvcache.server`` processes with
    ``base_args`` plus the test's own, and kills them (and removes their socket directories)
    when the test ends."""
    started: list[DaemonProcess] = []

    def start(*args: str, **kw: Any) -> DaemonProcess:
        d = DaemonProcess([*base_args, *args], **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()
        d.remove_runtime_dir()
