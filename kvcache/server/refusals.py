"""Refusals at a per-principal bound, counted where they happen and published in batches.

Apart from the handlers because it is one job with its own lock: a refusal is the cheapest
answer the daemon gives, and under a flood there are tens of thousands of them a second. One
event per refusal woke the event bus's dispatcher for each (it sleeps when idle) and took
about 15 % of the daemon's CPU in an await flood; a count per (principal, bound, request)
costs a dict update, and the daemon's loop publishes the counts each turn
(``Handlers.publish_refusals``).
"""

from __future__ import annotations

import threading
from collections import Counter

Key = tuple[str, str, str]
"""(principal, the bound's flag, the request's wire tag)."""


class RefusalTally:
    """Refusals counted since the last ``take``; thread-safe (workers and the I/O thread refuse)."""

    def __init__(self) -> None:
        self._counts: Counter[Key] = Counter()
        self._lock = threading.Lock()

    def add(self, principal: str, flag: str, request: str) -> None:
        with self._lock:
            self._counts[principal, flag, request] += 1

    def take(self) -> list[tuple[Key, int]]:
        """The counts since the last call, and start afresh; empty (and lock-free) when none."""
        if not self._counts:  # the loop asks every turn: no lock while nothing was refused
            return []
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return list(counts.items())


__all__ = ["RefusalTally"]
