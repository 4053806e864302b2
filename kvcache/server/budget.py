"""Per-client budgets: what one principal's requests may hold of the daemon at once.

Two rules share this one counter, each with its own state and limit:

* **Requests in flight** (``--max-in-flight-mb``): the bytes of a principal's requests that
  the I/O loop has read and not yet answered, queued for a worker or waiting on their copies.
  The loop reads every request as it arrives, whatever the workers' pace, so without a bound
  a client that sends faster than it is served (or never reads its replies) grows the
  daemon's memory with its backlog: 200 retrieves of 5 MB queued 1.6 GB. A request counts
  at least ``REQUEST_FLOOR`` bytes, so tiny ones are bounded by number too.
* **Awaiting retrieves** (``--max-awaited-tokens``): a retrieve that awaits chunks another
  engine is storing (the decode half of a prefill/decode split) is held up to the retrieve
  wait bound (``retrieve_wait_timeout_s``, 30 s) whatever arrives, with its keys and block
  ids: 200 awaits of a million tokens held 2 GiB for their 30 s. A decode instance awaits the
  prompts of the requests it holds blocks for, far below the default.

Per principal, so one tenant never takes another's share. Every engine of the daemon's own
user is one principal, as every plain loopback TCP client is another.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvcache.errors import LimitExceededError

REQUEST_FLOOR = 4096
"""The least a request in flight counts, in bytes: a queued job's own memory."""


class Budget:
    """Amounts held per principal name, up to ``limit`` each; thread-safe."""

    def __init__(self, limit: int, holding: str, unit: str, flag: str) -> None:
        self.limit = limit
        self._holding, self._unit, self._flag = holding, unit, flag
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, principal: str, amount: int) -> None:
        """Count ``amount`` for ``principal``, or raise ``LimitExceededError`` (nothing counted)."""
        with self._lock:
            held = self._held[principal]
            if held + amount > self.limit:
                raise LimitExceededError(
                    f"{self._holding} would hold {held + amount} {self._unit} at once for this "
                    f"client; the limit is {self.limit} ({self._flag})"
                )
            self._held[principal] = held + amount

    def give(self, principal: str, amount: int) -> None:
        """Uncount what ``take`` counted, once it is no longer held."""
        with self._lock:
            self._held[principal] -= amount
            if self._held[principal] <= 0:
                del self._held[principal]

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held[principal]


def awaited_tokens(limit: int) -> Budget:
    """The budget of token ids held by awaiting retrieves."""
    return Budget(limit, "retrieves awaiting a prefill's chunks", "token ids", "--max-awaited-tokens")


def in_flight_bytes(limit: int) -> Budget:
    """The budget of request bytes read and not yet answered."""
    return Budget(limit, "requests read and not yet answered", "bytes", "--max-in-flight-mb")


__all__ = ["REQUEST_FLOOR", "Budget", "awaited_tokens", "in_flight_bytes"]
