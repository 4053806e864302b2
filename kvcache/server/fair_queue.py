"""A worker lane's queue: one FIFO per principal, and who may start work next.

Apart from the loop (``daemon``) because it is one rule about sharing, not about sockets.
The lanes' worker threads, and the engine threads behind them, are the daemon's to share;
a plain FIFO let whoever queued most take them all (a tenant that pipelined 20,000
retrieves put every other tenant's L1 hit behind its whole backlog: 10 s instead of 4 ms).
Serving principals in turn fixed the queueing, but not the sharing: a tenant pipelining
stores still kept every worker, copy and completion thread busy, and another tenant's L1
hit, served at once, then waited for the CPU and the interpreter lock behind them (18 ms
instead of 1.7 ms, 2-core machine).

So the queue schedules principals as the kernel schedules threads, by **virtual time**:

* each principal is charged the time its requests were in service (dispatch to reply), and
  a request held in service past ``HOLD_GRACE_S`` is charged while it is held, so no
  principal stays the least-served by keeping long requests running;
* a principal may start a request only while no other *active* principal has used less
  (its virtual time is the least, within ``slice_s``), and while it has fewer than its
  share of ``in_flight`` requests in service (alone: all of them; with ``n`` active
  principals: ``in_flight // n``, at least one);
* a principal that becomes active again starts at the least virtual time of those active
  minus ``bonus_s``, never lower: a light tenant's request is served first and alone, for
  up to ``bonus_s`` of service, but idle time is not banked (a tenant idle for an hour gets
  no hour of priority), and a tenant that used less than its share keeps its lead;
* a principal stays active for ``linger_s`` after its last reply, so a client's think time
  between two requests does not hand the daemon back to a flood in between.

Within a principal the order is its arrival order, as before. ``get`` is O(principals)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

SLICE_S = 0.002
"""How far ahead of the least-served active principal another may be and still start work:
principals that used about the same run side by side, not strictly in turn."""
BONUS_S = 0.05
"""Service a principal that becomes active may get before a busier one runs again."""
LINGER_S = 0.01
"""How long a principal counts as active after its last reply (its client's think time)."""
HOLD_GRACE_S = 0.02
"""Service a request may take before its principal is charged for it while it runs."""
_TIE_S = 1e-6  # virtual times this close are equal (sums of clock readings round)
_MIN_WAIT_S = 0.0005  # the shortest wait for a running principal to catch up


@dataclass(slots=True)
class _Owner:
    queued: int = 0  # across every lane of the share
    running: int = 0
    vtime: float = 0.0  # service of its ended requests (shifted: see the module docstring)
    starts: list[float] = field(default_factory=list)  # its requests in service: their starts
    last_done: float = -1e18

    def served(self, now: float) -> float:
        """Its virtual time now: ended requests' service, plus what its requests in service
        held past ``HOLD_GRACE_S`` so far. A principal holding requests for long is charged
        while it holds them (charged only at the end, it stayed the least-served and held
        everyone else off meanwhile); a short request is charged at its end, so a principal's
        own copies in flight do not count against it twice as they overlap another's."""
        return self.vtime + sum(now - s - HOLD_GRACE_S for s in self.starts if now - s > HOLD_GRACE_S)


class FairShare:
    """The principals' accounts, shared by the lanes that serve them (a lookup flood on the
    fast lane must yield to another tenant's retrieve on the bulk lane too). Its lock is
    the lanes' lock."""

    def __init__(
        self,
        *,
        in_flight: int,
        slice_s: float = SLICE_S,
        bonus_s: float = BONUS_S,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # in_flight: the daemon's ``--fair-in-flight`` (``DaemonConfig.fair_in_flight``)
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self._in_flight, self._slice, self._bonus, self._linger = in_flight, slice_s, bonus_s, linger_s
        self.clock = clock
        self.lock = threading.Lock()
        self._lanes: list[FairQueue[Any]] = []
        self._owners: dict[str, _Owner] = {}
        self._floor = 0.0  # the least virtual time of the active owners, never decreasing
        self._active_until: dict[str, float] = {}  # see ``active``; replaced, never changed
        self._backlogged: frozenset[str] = frozenset()  # see ``backlogged``; replaced, never changed

    def active(self, now: float) -> list[str]:
        """The principals active at ``now``: with requests queued or in service, or within
        ``linger_s`` of their last reply. Read without the lock (copy threads ask it before
        each piece, ``server.copy_share``): a snapshot kept at every change of the accounts
        and compared with the clock here, so a linger that ended is never stale."""
        return [name for name, until in self._active_until.items() if until > now]

    def others_active(self, name: str | None, now: float) -> bool:
        """Whether a principal other than ``name`` is active at ``now`` (``active``, without
        the lock and without building the list: the I/O thread asks it between every two
        messages). ``name`` need not be active itself: a flood refused at admission never
        reaches the lanes."""
        return any(until > now and other != name for other, until in self._active_until.items())

    def backlogged(self) -> frozenset[str]:
        """The principals the lanes hold back: with requests queued that ``may_start`` last
        found over their share or ahead of a lighter principal (not those merely waiting for
        a worker to wake). Read without the lock, like ``active``."""
        return self._backlogged

    def vtime(self, owner: str) -> float:
        """``owner``'s virtual time (seconds of service, shifted as above); for tests."""
        with self.lock:
            o = self._owners.get(owner)
            return self._floor if o is None else o.served(self.clock())

    def join(self, lane: FairQueue[Any]) -> threading.Condition:
        """``lane``'s condition, on the share's lock: a slot's end may let any lane start."""
        self._lanes.append(lane)
        return threading.Condition(self.lock)

    # -- called with ``lock`` held ------------------------------------------------------------
    def queued(self, owner: str, now: float) -> None:
        o = self._owners.get(owner)
        if o is None or not self._active(o, now):  # (re)activated: no banked idle time
            self._refresh_floor(now)
            if o is None:
                o = self._owners[owner] = _Owner(vtime=self._floor - self._bonus)
            o.vtime = max(o.vtime, self._floor - self._bonus)
        o.queued += 1
        self._mark(owner, o)

    def started(self, owner: str, now: float) -> None:
        o = self._owners[owner]
        o.queued -= 1
        o.running += 1
        o.starts.append(now)
        if not o.queued:
            self._held(owner, False)

    def dropped(self, owner: str) -> None:
        o = self._owners[owner]
        o.queued -= 1
        if not o.queued:
            self._held(owner, False)
        self._mark(owner, o)

    def ended(self, owner: str, start: float) -> None:
        now = self.clock()
        o = self._owners[owner]
        o.running -= 1
        o.starts.remove(start)
        o.vtime += now - start
        o.last_done = now
        self._mark(owner, o)
        for lane in self._lanes:
            lane.wake()

    def may_start(self, waiting: Iterable[str], now: float) -> tuple[str | None, float | None]:
        """The first of ``waiting`` (owners with work queued on a lane) that may start work
        now, else None and how long until a linger ends (None: until something changes)."""
        active = [o for o in self._owners.values() if self._active(o, now)]
        if not active:
            return None, None
        served = {id(o): o.served(now) for o in active}
        least_owner = min(active, key=lambda o: served[id(o)])
        least = served[id(least_owner)]
        self._floor = max(self._floor, least)
        share = max(1, self._in_flight // len(active))
        gap: float | None = None  # how far the nearest waiting owner is ahead of the least
        for name in waiting:
            o = self._owners[name]
            if o.running >= share:
                self._held(name, True)
                continue
            ahead = served[id(o)] - least - self._slice
            if ahead <= _TIE_S:
                self._held(name, False)
                return name, None
            self._held(name, True)
            gap = ahead if gap is None else min(gap, ahead)
        wake: float | None = None
        if gap is not None and least_owner.running:  # it catches up once held past the grace
            until_held = max(0.0, min(least_owner.starts) + HOLD_GRACE_S - now)
            wake = max(until_held + gap / least_owner.running, _MIN_WAIT_S)
        for o in active:  # an idle owner's linger ending may let a busier one start
            if not o.queued and not o.running:
                left = o.last_done + self._linger - now
                wake = left if wake is None else min(wake, left)
        return None, wake

    def _held(self, name: str, held: bool) -> None:
        """Keep ``backlogged``'s view: ``name`` was found held back (over its share, or ahead
        of a lighter principal), or free to start; replaced whole, only on a change."""
        if (name in self._backlogged) != held:
            self._backlogged = self._backlogged | {name} if held else self._backlogged - {name}

    def _mark(self, name: str, o: _Owner) -> None:
        """Keep ``active``'s view of ``name`` (until when it is active); the view is
        replaced whole, never changed in place, as its readers hold no lock. Only a change
        copies it: a principal going from idle to busy, or from busy to its linger."""
        until = float("inf") if o.queued > 0 or o.running > 0 else o.last_done + self._linger
        if self._active_until.get(name) != until:
            self._active_until = {**self._active_until, name: until}

    def _active(self, o: _Owner, now: float) -> bool:
        return o.queued > 0 or o.running > 0 or now - o.last_done < self._linger

    def _refresh_floor(self, now: float) -> None:
        active = [o.served(now) for o in self._owners.values() if self._active(o, now)]
        if active:
            self._floor = max(self._floor, min(active))
        if len(self._owners) > 64:  # forget owners that would restart at the floor anyway
            for name in [
                n for n, o in self._owners.items() if not self._active(o, now) and o.vtime <= self._floor
            ]:
                del self._owners[name]
            self._active_until = {n: u for n, u in self._active_until.items() if n in self._owners}


class Slot:
    """One request in service, from ``FairQueue.get`` until ``end``; ``end`` charges its
    principal the time in between (idempotent: the first call counts)."""

    __slots__ = ("_ended", "_share", "_start", "owner")

    def __init__(self, share: FairShare, owner: str, start: float) -> None:
        self._share, self.owner, self._start, self._ended = share, owner, start, False

    def on_done(self, _future: object) -> None:
        """``end`` as a future's done-callback: the request's copies are done."""
        self.end()

    def end(self) -> None:
        with self._share.lock:
            if not self._ended:
                self._ended = True
                self._share.ended(self.owner, self._start)


class FairQueue(Generic[T]):
    """A blocking multi-producer, multi-consumer queue, fair across owners; thread-safe.
    ``get`` returns None (a worker's cue to leave) only once the queue is empty and
    ``stop`` was called: requests queued before the stop are still served, as with a FIFO
    and a sentinel put last. Every item ``get`` returns must have its slot ended."""

    def __init__(self, share: FairShare) -> None:
        self._share = share
        self._cv = share.join(self)
        self._items: dict[str, deque[T]] = {}  # insertion order: the turn order among equals
        self._len = 0
        self._stopped = False
        self._timed_until: float | None = None  # the end of the earliest timed wait of a worker

    def __len__(self) -> int:
        with self._cv:
            return self._len

    def put(self, owner: str, item: T) -> None:
        with self._cv:
            now = self._share.clock()
            self._share.queued(owner, now)
            self._items.setdefault(owner, deque()).append(item)
            self._len += 1
            # A worker is woken only when this owner may start now, or when only time will
            # let it (a linger ending, a long request's charge): a queued request never makes
            # another owner's start possible, and a flood read while it must wait for a slot's
            # end woke a worker per message for nothing (each a hand-off of the interpreter
            # lock); the end wakes one.
            name, wake = self._share.may_start((owner,), now)
            if name is not None or (wake is not None and not self._waiting_until(now + wake)):
                self._cv.notify()

    def get(self) -> tuple[T, Slot] | None:
        """The oldest item of the owner that may start work next, with its slot; or None
        once stopped and empty. Blocks while nothing may start (an owner over its share
        waits for one of its slots to end, a busier owner for a lighter one to go idle)."""
        with self._cv:
            while True:
                if not self._len and self._stopped:
                    return None
                now = self._share.clock()
                name, wake = self._share.may_start(self._items, now) if self._len else (None, None)
                if name is not None:
                    break
                mine = None
                if wake is not None and not self._waiting_until(now + wake):
                    mine = self._timed_until = now + wake
                self._cv.wait(wake)
                if mine is not None and self._timed_until == mine:
                    self._timed_until = None  # this worker is awake: no one waits until then
            items = self._items.pop(name)
            item = items.popleft()
            if items:
                self._items[name] = items  # to the back of the turn
            self._len -= 1
            self._share.started(name, now)
            self.wake()  # another owner may start too
            return item, Slot(self._share, name, now)

    def _waiting_until(self, when: float) -> bool:
        """Whether a worker already waits with a timeout that ends by ``when`` (lock held):
        then it looks again in time, and no other needs waking."""
        return self._timed_until is not None and self._timed_until <= when

    def wake(self) -> None:
        """Let one waiting worker look again (lock held): all of a lane's workers are alike,
        so when one cannot start anything, none can."""
        if self._len:
            self._cv.notify()

    def take_all(self) -> list[T]:
        """Remove and return every queued item (a draining daemon refuses them)."""
        with self._cv:
            out = []
            for name, items in self._items.items():
                for item in items:
                    self._share.dropped(name)
                    out.append(item)
            self._items.clear()
            self._len = 0
            self._cv.notify_all()
            return out

    def stop(self) -> None:
        """Let every ``get`` return None once the queue is empty (idempotent)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


__all__ = ["BONUS_S", "LINGER_S", "SLICE_S", "FairQueue", "FairShare", "Slot"]
