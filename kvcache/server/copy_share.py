"""Which principals' copies give way: those that want more copying than another active one.

Why: the lanes (``fair_queue``) decide which request starts, but a flood's copies already
running kept the daemon's core for whole time slices while another tenant's request waited
for it (docs/benchmarks.md, "Seventh pass"). So each piece of a CPU copy asks here first, and
a principal that gives way has it copied in the lowest CPU class (``transfer.lowered``).

The measure is demand in bytes: the copies each principal has queued or running now, across
all its caches (the handlers ``charge`` them at submit and take them back as they leave). Not
requests: one huge store in service against a client's small retrieve is a tie by count, and
an awaiting retrieve leaves the lanes' count (its slot ends while it waits) although its copy
runs later. Not a rate either: the bench's victim, storing and retrieving back to back, copies
as many bytes a second as the flood it suffers from (with a decayed rate and a margin of 2 the
flood was lowered too seldom: 1.6x to 3.5x), whereas what sets a flood apart is how much it
keeps waiting at once. A principal gives way while an active principal (``FairShare.active``:
requests queued or in service, or its think time after a reply) other than itself wants less.
The bar is the least demand among the others that copy at all; one that is active but copies
nothing (between its requests) sets the bar at zero only when none of the others copies, so
a third tenant's think time does not lower a light tenant along with the flood. Alone, or
among principals wanting the same, a principal keeps its priority.

Known limits: demand is what waits *now*, so a client sending small copies one at a time
keeps its priority against another's single large one (the larger gives way meanwhile), and
two tenants taking turns lower each other's copies during each other's think time. Lowered
copies get only what the cores leave idle in the daemon's scheduling group, so a principal
that gives way can see its copies slowed to their deadline on a daemon held to one core, and
a lighter tenant waiting for L1 room that only those copies' pins could free waits for them
too. A tenant that only looks up (inline on the I/O thread) is not counted as active.

Thread rules: ``charge`` from any thread (a lock per principal, held for an addition);
``gives_way`` from copy workers, lock-free: the principals' table is replaced whole when one
is added, and the lanes' activity is a snapshot (``FairShare.active``).
"""

from __future__ import annotations

import threading

from kvcache.server.fair_queue import FairShare


class PrincipalCopies:
    """One principal's side of the copy share: what its caches' handlers talk to
    (``transfer.base.CopyPriority``)."""

    __slots__ = ("_lock", "_shares", "bytes", "name")

    def __init__(self, shares: CopyShares, name: str) -> None:
        self._shares, self.name = shares, name
        self._lock = threading.Lock()
        self.bytes = 0
        """Bytes of copies queued or running, over every cache of this principal."""

    def charge(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes

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
                mine = PrincipalCopies(self, name)
                self._principals = {**self._principals, name: mine}
            return mine

    def gives_way(self, mine: PrincipalCopies) -> bool:
        wanted = mine.bytes
        if wanted <= 0:
            return False
        principals = self._principals
        others = [
            principals[name].bytes if name in principals else 0
            for name in self._share.active(self._share.clock())
            if name != mine.name
        ]
        if not others:
            return False
        copying = [b for b in others if b > 0]
        return wanted > (min(copying) if copying else 0)


__all__ = ["CopyShares", "PrincipalCopies"]
