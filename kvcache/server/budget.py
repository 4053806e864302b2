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
* **Awaiting retrieves** (``--max-awaiting-retrieves``): the same retrieves, counted. Each one
  costs the engine's retrieve waiter a pass and an answer at its bound whatever its size, so
  20,000 small awaits (5 M tokens, far under the token bound) answered 5 to 50 s past their
  bound; the count keeps a principal's awaits answerable within about a second of it.
* **Requests in flight** by number (``--max-requests-in-flight``): the count beside the bytes,
  so a principal's queue of tiny requests stays bounded in entries, not only in bytes.

Per principal, so one tenant never takes another's share. Every engine of the daemon's own
user is one principal, as every plain loopback TCP client is another.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from kvcache.errors import PrincipalLimitError

REQUEST_FLOOR = 4096
"""The least a request in flight counts, in bytes: a queued job's own memory."""


class Budget:
    """Amounts held per principal name, up to ``limit`` each; thread-safe."""

    def __init__(self, limit: int, holding: str, unit: str, flag: str) -> None:
        self.limit = limit
        self.flag = flag
        """The flag that sets ``limit``: what a refusal names (the error, ``REQUEST_REFUSED``)."""
        self._holding, self._unit = holding, unit
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, principal: str, amount: int) -> None:
        """Count ``amount`` for ``principal``, or raise ``PrincipalLimitError`` (nothing counted)."""
        with self._lock:
            held = self._held[principal]
            if held + amount > self.limit:
                raise self._refusal(held + amount)
            self._held[principal] = held + amount

    def refusal(self) -> PrincipalLimitError:
        """The refusal of a request when its principal holds the whole ``limit``: one message
        whatever was held, so a caller may encode it once (the I/O thread's early replies)."""
        return PrincipalLimitError(
            f"{self._holding} would hold more than {self.limit} {self._unit} at once for this "
            f"client ({self.flag}); back off and retry",
            self.flag,
        )

    def _refusal(self, would_hold: int) -> PrincipalLimitError:
        return PrincipalLimitError(
            f"{self._holding} would hold {would_hold} {self._unit} at once for this "
            f"client; the limit is {self.limit} ({self.flag}); back off and retry",
            self.flag,
        )

    def give(self, principal: str, amount: int) -> None:
        """Uncount what ``take`` counted, once it is no longer held."""
        with self._lock:
            self._held[principal] -= amount
            if self._held[principal] <= 0:
                del self._held[principal]

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held[principal]


Takes = tuple[tuple[Budget, int], ...]
"""What one request holds: ``(budget, amount)`` pairs, given back together (``give_each``)."""


def take_each(principal: str, takes: Sequence[tuple[Budget, int]]) -> None:
    """Take every ``(budget, amount)`` for ``principal``, or none: on a refusal what was
    taken is given back and the refusing budget's ``PrincipalLimitError`` raised."""
    done: list[tuple[Budget, int]] = []
    try:
        for budget, amount in takes:
            budget.take(principal, amount)
            done.append((budget, amount))
    except PrincipalLimitError:
        for budget, amount in done:
            budget.give(principal, amount)
        raise


def give_each(principal: str, takes: Sequence[tuple[Budget, int]]) -> None:
    """Give back what ``take_each`` took."""
    for budget, amount in takes:
        budget.give(principal, amount)


def awaited_tokens(limit: int) -> Budget:
    """The budget of token ids held by awaiting retrieves."""
    return Budget(limit, "retrieves awaiting a prefill's chunks", "token ids", "--max-awaited-tokens")


def awaiting_retrieves(limit: int) -> Budget:
    """The budget of retrieves awaiting a prefill's chunks, by number."""
    return Budget(limit, "retrieves awaiting a prefill's chunks", "retrieves", "--max-awaiting-retrieves")


def in_flight_requests(limit: int) -> Budget:
    """The budget of requests read and not yet answered, by number."""
    return Budget(limit, "requests read and not yet answered", "requests", "--max-requests-in-flight")


def in_flight_bytes(limit: int) -> Budget:
    """The budget of request bytes read and not yet answered."""
    return Budget(limit, "requests read and not yet answered", "bytes", "--max-in-flight-mb")


__all__ = [
    "REQUEST_FLOOR",
    "Budget",
    "Takes",
    "awaited_tokens",
    "awaiting_retrieves",
    "give_each",
    "in_flight_bytes",
    "in_flight_requests",
    "take_each",
]
