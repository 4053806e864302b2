"""The client's circuit breaker: after the daemon fails to answer, fail fast until it does.

Separate from ``KVCacheClient`` so the rule can be read on its own. Without it a dead daemon
costs every call its full timeout: a vLLM scheduler doing lookups, block reports and
end-of-request notices for four short requests waited 16 timeouts. With it, the first call
that times out while the daemon was silent (nothing heard from it, on any socket, since the
call was sent: ``heard`` / ``silent_since``) opens the breaker; a call that is merely slow
while others are answered fails alone; every later call fails at once (a lookup is a miss, a store
is skipped, a notice is dropped and counted) while one background probe per
``probe_interval_s`` asks the daemon; the first answer closes the breaker.
"""

from __future__ import annotations

import threading
import time


class CircuitBreaker:
    """Thread-safe open/closed state with counters; ``clock`` is injectable for tests."""

    def __init__(self, probe_interval_s: float = 0.5) -> None:
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._open_since: float | None = None
        self._heard = time.monotonic()
        self.trips = 0
        """Times the breaker opened."""
        self.short_circuited = 0
        """Calls refused at once while open (never sent)."""

    @property
    def open(self) -> bool:
        return self._open_since is not None

    def trip(self) -> bool:
        """Open (a call timed out); True if it was closed before."""
        with self._lock:
            if self._open_since is not None:
                return False
            self._open_since = time.monotonic()
            self.trips += 1
            return True

    def close(self) -> bool:
        """Close (the daemon answered); True if it was open."""
        with self._lock:
            was, self._open_since = self._open_since is not None, None
            return was

    def refuse(self) -> bool:
        """True (and counted) if a call must fail now without being sent."""
        with self._lock:
            if self._open_since is None:
                return False
            self.short_circuited += 1
            return True

    def heard(self) -> None:
        """The daemon sent something (any reply, on any socket): it is alive now."""
        self._heard = time.monotonic()

    def silent_since(self, since: float) -> bool:
        """True if the daemon sent nothing after ``since`` (``time.monotonic()``): a call
        sent then that timed out found it silent, not merely slow to answer that call."""
        return self._heard < since

    def open_for(self) -> float:
        """Seconds the breaker has been open (0 when closed)."""
        since = self._open_since
        return 0.0 if since is None else time.monotonic() - since


__all__ = ["CircuitBreaker"]
