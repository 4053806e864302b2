"""Deadline: the one moment past which a request's copies may not start, on the monotonic clock.

A leaf of its own because every layer a request crosses bounds its waits by the same moment:
the daemon converts the wire's ``deadline_ms`` (the client's wall clock) into one at its edge
(``server.deadlines``), the engine ends its waits for L1 room and L2 loads there, and the
transfer job refuses to start after it. One type, so no layer re-derives it from another clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Deadline:
    """A moment on the ``time.monotonic()`` scale (``at``): immune to wall-clock steps."""

    at: float

    @classmethod
    def within(cls, seconds: float) -> Deadline:
        """The moment ``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def passed(self) -> bool:
        return time.monotonic() > self.at

    def left(self) -> float:
        """Seconds until the deadline, never negative (a wait bound)."""
        return max(0.0, self.at - time.monotonic())

    def earliest(self, other: Deadline | None) -> Deadline:
        """The earlier of the two (``other`` None: this one)."""
        return self if other is None or self.at <= other.at else other


__all__ = ["Deadline"]
