"""Which thread serves a request: the I/O thread itself, the fast lane or the bulk lane.

Apart from the loop (``daemon``) because it is one rule about requests, not about sockets:
what never waits on I/O is served inline, because a thread hand-off costs about as much as
the work; lookups and status go to the fast lane, so a slow store never delays them; what
moves bytes or registers goes to the bulk lane.
"""

from __future__ import annotations

from typing import Literal

from kvcache.protocol import messages as m

Lane = Literal["inline", "fast", "bulk"]

_INLINE = (m.Ping, m.ReportBlockAllocations, m.EndSession)
_FAST = (m.Lookup, m.LookupBatch, m.Status)

INLINE_LOOKUP_MAX_TOKENS = 1 << 16
"""Lookups up to this many tokens run on the I/O thread (a hash per chunk: microseconds);
longer ones go to the fast lane, so one huge prompt never stalls every other client's reply."""


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


__all__ = ["INLINE_LOOKUP_MAX_TOKENS", "Lane", "lane_of"]
