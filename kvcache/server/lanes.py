"""Which thread serves a request: the I/O thread itself, the fast lane or the bulk lane.

Apart from the loop (``daemon``) because it is one rule about requests, not about sockets:
what never waits on I/O is served inline, because a thread hand-off costs about as much as
the work; lookups and status go to the fast lane, so a slow store never delays them; what
moves bytes or registers goes to the bulk lane. The I/O thread is shared by every principal,
so each gets a slice of it per read (``InlineShare``): past it, its inline requests go to the
fast lane, whose workers share the daemon between principals (``fair_queue``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Literal

from kvcache.protocol import messages as m

Lane = Literal["inline", "fast", "bulk"]

_INLINE = (m.Ping, m.ReportBlockAllocations, m.EndSession)
_FAST = (m.Lookup, m.LookupBatch, m.Status)

INLINE_LOOKUP_MAX_TOKENS = 1 << 16
"""Lookups up to this many tokens run on the I/O thread (a hash per chunk: microseconds);
longer ones go to the fast lane, so one huge prompt never stalls every other client's reply."""


INLINE_SLICE_S = 0.002
"""I/O-thread time one principal's inline requests may take per read of the socket (at most
``unfinished.CHECK_EVERY_S``); its next inline requests of that read go to the fast lane.
Measured before: 5,000 pipelined lookups of 51 k tokens each of one tenant, all inline, held
another tenant's replies for up to 0.1 s each."""


FORWARD_EVERY_S = 0.0005
"""How often a read of the socket stops to forward the workers' replies while one principal
is active, so a reply waits for at most this much of reading, not for the whole read (it was
5 ms, as long as a victim's whole L1 hit several times over). Each stop also yields the
processor (``os.sched_yield``, which lets go of the interpreter lock): a thread the read woke
(a worker, a completion) runs now instead of waiting for the kernel to take the core from a
read that never blocks, which on a busy core is a time slice and then the interpreter's
switch interval, per hand-off; a stop costs a ``ZMQ_EVENTS`` read and a system call.

While a principal other than the last message's sender is active (``FairShare.others_active``;
the sender need not be: a flood refused at admission never reaches the lanes) the read stops
between every two messages: one principal's reading then never holds another's reply or woken
thread for longer than a message. Under a store flood, another tenant's L1-hit p99 went from
2.1x to 2.7x its unflooded p99 (a stop every 0.5 ms) to 1.2x to 1.7x (with backlogged
principals never lowering another's copies, ``copy_share``; docs/benchmarks.md, "Eighth
pass"). Not always: alone, a tenant pipelining pings got half the throughput with a stop per
message (20,000 in 1.0 s against 0.5 s)."""


class InlineShare:
    """The I/O-thread time each principal's inline requests took in one read (``INLINE_SLICE_S``)."""

    def __init__(self) -> None:
        self._spent: dict[str, float] = {}

    def lane(self, principal: str, lane: Lane) -> Lane:
        """``lane``, or the fast lane for an inline request of a principal past its slice."""
        if lane == "inline" and self._spent.get(principal, 0.0) >= INLINE_SLICE_S:
            return "fast"
        return lane

    @contextlib.contextmanager
    def timed(self, principal: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._spent[principal] = self._spent.get(principal, 0.0) + time.perf_counter() - start


def lane_of(body: m.RequestBody, inline_lookups: bool) -> Lane:
    """The lane of ``body``; ``inline_lookups`` off when a lookup may wait (an L2 tier)."""
    if isinstance(body, _INLINE) or (inline_lookups and _small_lookup(body)):
        return "inline"
    return "fast" if isinstance(body, _FAST) else "bulk"


def _small_lookup(body: m.RequestBody) -> bool:
    if isinstance(body, m.LookupBatch):  # the whole batch is one hand-off, or none
        tokens = sum(item.head + len(item.token_ids.data) // item.token_ids.width for item in body.items)
        return tokens <= INLINE_LOOKUP_MAX_TOKENS
    if not isinstance(body, m.Lookup):
        return False
    return len(body.token_ids.data) <= INLINE_LOOKUP_MAX_TOKENS * body.token_ids.width


__all__ = ["FORWARD_EVERY_S", "INLINE_LOOKUP_MAX_TOKENS", "INLINE_SLICE_S", "InlineShare", "Lane", "lane_of"]
