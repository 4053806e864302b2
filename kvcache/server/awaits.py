"""The bound on what one client's awaiting retrieves (``Retrieve.await_chunks``) hold at once.

Separate from the handlers because it is one rule with its own state: a retrieve that awaits
chunks another engine is storing (the decode half of a prefill/decode split) is held by the
daemon up to the retrieve wait bound (``retrieve_wait_timeout_s``, 30 s) whatever arrives,
with its keys and block ids, so a client that sends awaits for chunks nobody stores holds
that memory, and a share of the retrieve waiter's work, for each one: without a bound, 200
awaits of a million tokens each held 2 GiB of the daemon's memory for their 30 s. The bound
is on token ids (what a request's memory grows with), per principal, so one tenant's awaits
never take another's share (every engine of the daemon's own user is one principal, as
every plain loopback TCP client is another). A decode instance awaits the prompts of the
requests it holds blocks for, far below the default.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvcache.errors import LimitExceededError


class AwaitBudget:
    """Token ids held by awaiting retrieves, per principal name; thread-safe."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, principal: str, tokens: int) -> None:
        """Count ``tokens`` for ``principal``, or raise ``LimitExceededError`` (nothing counted)."""
        with self._lock:
            held = self._held[principal]
            if held + tokens > self.max_tokens:
                raise LimitExceededError(
                    f"retrieves awaiting a prefill's chunks would hold {held + tokens} token ids at "
                    f"once for this client; the limit is {self.max_tokens} (--max-awaited-tokens)"
                )
            self._held[principal] = held + tokens

    def give(self, principal: str, tokens: int) -> None:
        """Uncount what ``take`` counted once the retrieve ended."""
        with self._lock:
            self._held[principal] -= tokens
            if self._held[principal] <= 0:
                del self._held[principal]

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held[principal]


__all__ = ["AwaitBudget"]
