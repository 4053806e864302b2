"""The retrieves waiting for L2 loads, each copied as soon as its own chunks settled.

Separate from the retrieve path so that ``EngineParts`` can hold the set without importing
the retrieve path (which imports the parts); the ops are the retrieve path's, seen here only
through ``WaitingOp``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from kvcache.deadline import Deadline
from kvcache.records import ChunkKey

AWAIT_POLL_S = 0.05
"""How often a retrieve awaiting chunks another daemon is storing looks in L2 for them (no
event says a chunk reached L2 from elsewhere): a bounded poll, at most this much latency
added to a prefill/decode split across hosts, on top of the L2 round trip."""


POLL_BATCH = 64
"""Most waiting retrieves one pass polls L2 for (``WaitingOp.poll``, an L2 round trip each):
the rest are polled by the next passes, in turn, so a flood of awaits of chunks nobody stores
costs the waiter thread a bounded time per interval, and the retrieves behind it still run."""


class WaitingOp(Protocol):
    """What the set needs of a waiting retrieve (``retrieve._RetrieveOp``)."""

    deadline: Deadline
    claimed: bool
    served: threading.Event

    def settled(self) -> bool:
        """(the set's lock held) Whether its copy need wait no longer."""

    def waits_on(self) -> ChunkKey | None:
        """(the set's lock held, ``settled`` just said False) The one chunk whose change (its
        load settling, or its store making it READY) may settle it; None: only its deadline."""

    def finish_wait(self) -> None:
        """(claimed, no lock held) Copy what is READY; sets ``served``."""

    def polls(self) -> bool:
        """(the set's lock held) Whether it awaits chunks only L2 may bring (``poll``)."""

    def poll(self) -> None:
        """(no lock held) Begin loading what L2 now holds of its awaited chunks."""


class WaitingRetrieves:
    """The retrieves waiting for their chunks to come from L2 or from a store
    (``EngineParts.waiting``), indexed by the chunk each waits on.

    Guarded by ``EngineParts.loads_settled``; whoever settles a load or finishes a store
    calls ``notify_settled`` with the chunks' keys, and only the retrieves waiting on those
    keys are looked at again: a wake-up costs O(woken), not O(waiting), so thousands of
    retrieves awaiting chunks nobody stores (a hostile ``await_chunks`` flood) cost nothing
    per settled load. Deadlines are a heap, so a retrieve is answered at its bound however
    many wait. Each op here also has a pass queued on (or running on) the retrieve waiter, so
    some pass is always waiting while an op is here; that pass serves every op whose chunks
    settled or whose deadline passed, in the order they settle, so one retrieve never waits
    behind another's loads. Each op is claimed once: the thread that claims it cuts and copies
    it. NOTE: a pass still brings in its own op's missing chunks (``_bring_in``) in queue
    order; an op whose lookup began its loads skips that.

    Why no lost wake-up: an op is checked (``settled``) and indexed under one lock hold, and
    every change that can settle it happens before a ``notify_settled`` of its key, which takes
    that lock; so a change is either seen by the check or wakes the index afterwards.
    """

    def __init__(self, settled: threading.Condition) -> None:
        self._settled = settled
        self._ops: dict[WaitingOp, None] = {}  # every op waiting (insertion-ordered)
        self._unchecked: dict[WaitingOp, None] = {}  # added or woken: ``settled`` to be asked
        self._by_key: dict[ChunkKey, dict[WaitingOp, None]] = {}
        self._key_of: dict[WaitingOp, ChunkKey] = {}
        self._deadlines: list[tuple[float, int, WaitingOp]] = []  # a heap; stale entries skipped
        self._seq = itertools.count()  # ties in the heap never compare ops
        self._polling: dict[WaitingOp, None] = {}  # awaiting what only L2 may bring, in poll turn

    def add(self, op: WaitingOp) -> None:
        """(lock held) Wait for ``op``'s chunks from now on."""
        self._ops[op] = None
        self._unchecked[op] = None
        heapq.heappush(self._deadlines, (op.deadline.at, next(self._seq), op))
        self._settled.notify_all()  # a waiting pass looks at it now

    def discard(self, op: WaitingOp) -> None:
        """(lock held)"""
        if self._ops.pop(op, 0) is None:
            self._forget(op)

    def wake(self, keys: Iterable[ChunkKey]) -> None:
        """(lock held) The chunks ``keys`` changed: their waiting ops are checked again."""
        for key in keys:
            for op in self._by_key.pop(key, ()):
                del self._key_of[op]
                self._unchecked[op] = None

    def __contains__(self, op: object) -> bool:
        return op in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    def serve(
        self, own: WaitingOp, stop: threading.Event, hand_over: Callable[[threading.Event], bool]
    ) -> None:
        """Until ``own`` was served (by this thread or another), copy each waiting op as
        soon as it is due: its chunks settled, its deadline passed, or (``own`` only)
        ``stop`` set. While ``own`` waits and a retrieve that has not yet run is queued,
        ``hand_over(stop)`` (the waiter's) queues this pass again behind it and this pass
        returns: ``own`` stays here, served by whichever pass runs, so a long wait (a
        hostile ``await_chunks`` too) never holds other retrieves back."""
        while True:
            polling: list[WaitingOp] = []
            with self._settled:
                due = self._take_due(own if stop.is_set() else None)
                if not due:
                    if own.claimed:
                        break
                    if hand_over(stop):
                        return
                    soonest = self._soonest(own)
                    polling = self._poll_turn()
                    self._settled.wait(min(soonest, AWAIT_POLL_S) if self._polling else soonest)
            for op in polling:  # outside the lock: a poll asks L2
                op.poll()
            for op in due:
                op.finish_wait()
        own.served.wait()  # claimed by another thread: it is copying it now

    def _take_due(self, forced: WaitingOp | None) -> list[WaitingOp]:
        due: dict[WaitingOp, None] = {}
        if forced is not None and forced in self._ops:
            due[forced] = None
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            op = heapq.heappop(self._deadlines)[2]
            if op in self._ops:
                due[op] = None
        unchecked, self._unchecked = self._unchecked, {}
        for op in unchecked:
            if op in due:
                continue
            if op.settled():
                due[op] = None
                continue
            key = op.waits_on()
            if key is not None:
                self._key_of[op] = key
                self._by_key.setdefault(key, {})[op] = None
            if op.polls():
                self._polling[op] = None
            else:
                self._polling.pop(op, None)
        for op in due:
            del self._ops[op]
            self._forget(op)
            op.claimed = True
        if len(self._deadlines) > 2 * len(self._ops) + 64:  # served early: drop their entries
            self._deadlines = [entry for entry in self._deadlines if entry[2] in self._ops]
            heapq.heapify(self._deadlines)
        return list(due)

    def _forget(self, op: WaitingOp) -> None:
        self._unchecked.pop(op, None)
        self._polling.pop(op, None)
        key = self._key_of.pop(op, None)
        if key is not None:
            waiting = self._by_key[key]
            del waiting[op]
            if not waiting:
                del self._by_key[key]

    def _soonest(self, own: WaitingOp) -> float:
        """Seconds until the next deadline (stale heap entries dropped on the way)."""
        while self._deadlines and self._deadlines[0][2] not in self._ops:
            heapq.heappop(self._deadlines)
        at = self._deadlines[0][0] if self._deadlines else own.deadline.at
        return max(0.0, at - time.monotonic())

    def _poll_turn(self) -> list[WaitingOp]:
        """The next ``POLL_BATCH`` polling ops, each moved to the back of the turn."""
        turn = list(itertools.islice(self._polling, POLL_BATCH))
        for op in turn:
            del self._polling[op]
            if op.polls():
                self._polling[op] = None
        return turn


def notify_settled(
    settled: threading.Condition, keys: Iterable[ChunkKey] = (), waiting: WaitingRetrieves | None = None
) -> None:
    """Wake the retrieves waiting on ``settled`` (``EngineParts.loads_settled``): the chunks
    ``keys`` settled (a load ended, a store made them READY: ``waiting``'s ops on them are
    checked again), or (no keys: the retrieve waiter's ``wake``) their ``stop`` was set."""
    with settled:
        if waiting is not None:
            waiting.wake(keys)
        settled.notify_all()


__all__ = ["AWAIT_POLL_S", "POLL_BATCH", "WaitingOp", "WaitingRetrieves", "notify_settled"]
