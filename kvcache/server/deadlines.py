"""A client's deadline on the daemon's side: late requests refused, and the request's ``Deadline``.

Separate from the handlers because the same two rules guard every request that moves
bytes, whether it is answered at once or when its copies complete: a request that arrives
after its client stopped waiting is refused before anything is submitted, and an accepted
one hands the engine the moment past which no copy of the client's blocks may start. The wire
keeps the client's wall clock (``deadline_ms``); this is the one place it becomes a monotonic
``Deadline``.
"""

from __future__ import annotations

import time

from kvcache.deadline import Deadline
from kvcache.errors import DeadlineExceededError

DEADLINE_MARGIN_S = 0.05
"""A request is refused this long before its client's deadline: the copy itself takes time,
and it must be over before the client gives up on it and reuses the blocks."""


def accept_deadline(deadline_ms: int, op: str) -> Deadline | None:
    """The request's ``Deadline``: the client's, less the margin, on the monotonic clock (the
    engine's waits end there and no copy of the client's blocks starts after it); None when
    the client set none.

    Refuses (``DeadlineExceededError``) a request whose client has stopped, or is about to
    stop, waiting for it: one that sat in a queue, or in the socket of a stalled daemon.
    Same-host clients share the wall clock; a remote one's skew eats into the margin."""
    if not deadline_ms:
        return None
    left = deadline_ms / 1000 - DEADLINE_MARGIN_S - time.time()
    if left < 0:
        raise DeadlineExceededError(
            f"{op} arrived after its client's deadline; no byte was moved (the engine may "
            "have reused the blocks by now)"
        )
    return Deadline.within(left)


__all__ = ["DEADLINE_MARGIN_S", "accept_deadline"]
