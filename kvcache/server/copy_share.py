"""Which principals' copies give way: those that want more copying than another active one.

Why: the lanes (``fair_queue``) decide which request starts, but a flood's copies already
running kept the daemon's core for whole time slices while another tenant's request waited
for it (docs/benchmarks.md, "Seventh pass"). So each piece of a CPU copy asks here first, and
a principal that gives way has it copied in the lowest CPU class (``transfer.lowered``): it
loses nothing while the core is free, and never holds it against a lighter tenant.

The measure is demand in bytes: the copies each principal has queued or running, across all
its caches (the handlers ``charge`` them at submit and take them back when done). Not requests:
one huge store in service against a client's one small retrieve is a tie by count, and an
awaiting retrieve leaves the lanes' count (its slot ends while it waits) although its copy runs
later. A principal gives way while an active principal (``FairShare.active``: requests queued or
in service, or its think time after a reply) other than itself copies less than it does. The
bar is the least copying among the others that copy at all; a principal that is active but
copies nothing (between requests) sets the bar at zero only when none of the others copies, so
a third tenant's think time does not lower a light tenant along with the flood it should be
shielded from. Alone, or among equals, a principal keeps its priority.

What it costs the one that gives way: while a lighter principal is active its copies get what
the cores leave idle, so on a daemon held to one core a client that keeps it busy one small
request at a time slows a heavier client's copies (to their deadline, at worst). A tenant that
only looks up (inline on the I/O thread) is not counted as active: copies do not give way to it.

Thread rules: ``charge`` from any thread (a lock per principal, held for an addition);
``gives_way`` from copy workers, lock-free: the principals' table is replaced whole when one is
added, and the lanes' activity is a snapshot (``FairShare.active``).
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
