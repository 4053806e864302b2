"""Which principals' copies give way: those that want more copying than another active one.

Why: the lanes (``fair_queue``) decide which request starts, but a flood's copies already
running kept the daemon's core for whole time slices while another tenant's request waited
for it (docs/benchmarks.md, "Seventh pass"). So each piece of a CPU copy asks here first, and
a principal that gives way has it copied in the lowest CPU class (``transfer.lowered``).

The measure is demand in bytes: the copies each principal has queued or running, across all
its caches (the handlers ``charge`` them at submit and take them back as they leave), at
their peak over the last ``DEMAND_WINDOW_S`` to twice that; and a principal the lanes hold
back (``FairShare.backlogged``: requests queued over its share, or while it is ahead of a
lighter principal) wants without bound, since what it copies now is what the lanes let it.
Not requests: one huge store in service against a client's small retrieve is a tie by count,
and an awaiting retrieve leaves the lanes' count (its slot
ends while it waits) although its copy runs later. Not a rate either: the bench's victim,
storing and retrieving back to back, copies as many bytes a second as the flood it suffers
from (with a decayed rate and a margin of 2 the flood was lowered too seldom: 1.6x to 3.5x),
whereas what sets a flood apart is how much it keeps waiting at once. Not the bytes of this
instant alone: a flood the lanes held back, or between two bursts, copies nothing at that
instant, and counted so it lowered the very victim it was held back for (the victim's copies
gave way 395 times of 476 under a store flood on the noisy bench; docs/benchmarks.md,
"Eighth pass").

A principal gives way while an active principal (``FairShare.active``: requests queued or in
service, or its think time after a reply) other than itself wants less. The bar is the least
demand among the others that copy at all; one that is active but has copied nothing in the
window sets the bar at zero only when none of the others copies, so a third tenant's think
time does not lower a light tenant along with the flood. Alone, or among principals wanting
the same (two backlogged ones, or two taking turns with equal loads), a principal keeps its
priority.

Known limits: a client sending small copies one at a time keeps its priority against
another's single large one (the larger gives way meanwhile), and a principal that stops
flooding is still counted at its peak for up to two windows. The bar is the least demand, and
principals are the unit: a tenant holding several keys can keep one of them active with tiny
copies and so lower every other principal that copies more (a victim included, back to the
kernel's sharing between lowered copies), or split a flood into keys each copying no more
than the victim; give one tenant one key. Lowered copies get only what the
cores leave idle in the daemon's scheduling group, so a principal that gives way can see its
copies slowed to their deadline on a daemon held to one core, and a lighter tenant waiting
for L1 room that only those copies' pins could free waits for them too. A tenant that only
looks up (inline on the I/O thread) is not counted as active.

Thread rules: ``charge`` from any thread (a lock per principal, held for an addition);
``gives_way`` from copy workers, lock-free: the principals' table is replaced whole when one
is added, and the lanes' activity and backlog are snapshots (``FairShare.active``,
``FairShare.backlogged``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from kvcache.server.fair_queue import FairShare

DEMAND_WINDOW_S = 0.1
"""How long a principal's peak of copies in flight counts as its demand (see the module
docstring): longer than a client's think time between two requests, and than the lanes
holding a backlogged principal back while another is served."""


class PrincipalCopies:
    """One principal's side of the copy share: what its caches' handlers talk to
    (``transfer.base.CopyPriority``)."""

    __slots__ = ("_clock", "_lock", "_shares", "_window", "bytes", "name")

    def __init__(self, shares: CopyShares, name: str, clock: Callable[[], float]) -> None:
        self._shares, self.name, self._clock = shares, name, clock
        self._lock = threading.Lock()
        self.bytes = 0
        """Bytes of copies queued or running, over every cache of this principal."""
        # (end of the current window, the most ``bytes`` was in it, ... in the one before):
        # one tuple, replaced whole, so a reader without the lock never sees half a rotation
        self._window: tuple[float, int, int] = (-1e18, 0, 0)

    def charge(self, nbytes: int) -> None:
        now = self._clock()
        with self._lock:
            before = self.bytes
            self.bytes += nbytes
            end, peak, prev = self._window
            if now >= end:  # a new window; what was in flight until now was so in the last one too
                prev = max(peak if now < end + DEMAND_WINDOW_S else 0, before)
                end, peak = now + DEMAND_WINDOW_S, before
            self._window = (end, max(peak, self.bytes), prev)

    def demand(self, now: float) -> int:
        """The most bytes this principal had in flight over the last one to two windows
        (its bytes now at least). Read without the lock (``bytes`` and the window are each
        replaced whole)."""
        wanted, (end, peak, prev) = self.bytes, self._window
        if now < end:
            return max(wanted, peak, prev)
        if now < end + DEMAND_WINDOW_S:
            return max(wanted, peak)
        return wanted

    def gives_way(self) -> bool:
        return self._shares.gives_way(self)


class CopyShares:
    """The daemon's principals' copy demand, and who gives way (see the module docstring)."""

    def __init__(self, share: FairShare) -> None:
        self._share = share
        self._lock = threading.Lock()
        self._principals: dict[str, PrincipalCopies] = {}  # replaced whole, never changed

    def principal(self, name: str) -> PrincipalCopies:
        """``name``'s side, made on its first registration and kept (a few bytes each)."""
        with self._lock:
            mine = self._principals.get(name)
            if mine is None:
                mine = PrincipalCopies(self, name, self._share.clock)
                self._principals = {**self._principals, name: mine}
            return mine

    def gives_way(self, mine: PrincipalCopies) -> bool:
        if mine.bytes <= 0:
            return False
        now = self._share.clock()
        principals, backlogged = self._principals, self._share.backlogged()

        def demand(name: str) -> float:
            if name in backlogged:  # the lanes hold it back: it wants more than it copies now
                return math.inf
            return principals[name].demand(now) if name in principals else 0

        wanted = demand(mine.name)
        others = [demand(name) for name in self._share.active(now) if name != mine.name]
        if not others:
            return False
        copying = [b for b in others if b > 0]
        return wanted > (min(copying) if copying else 0)


__all__ = ["DEMAND_WINDOW_S", "CopyShares", "PrincipalCopies"]
