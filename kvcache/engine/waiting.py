"""The retrieves waiting for L2 loads, each copied as soon as its own chunks settled.

Separate from the retrieve path so that ``EngineParts`` can hold the set without importing
the retrieve path (which imports the parts); the ops are the retrieve path's, seen here only
through ``WaitingOp``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvcache.deadline import Deadline

AWAIT_POLL_S = 0.05
"""How often a retrieve awaiting chunks another daemon is storing looks in L2 for them (no
event says a chunk reached L2 from elsewhere): a bounded poll, at most this much latency
added to a prefill/decode split across hosts, on top of the L2 round trip."""


class WaitingOp(Protocol):
    """What the set needs of a waiting retrieve (``retrieve._RetrieveOp``)."""

    deadline: Deadline
    claimed: bool
    served: threading.Event

    def settled(self) -> bool:
        """(the set's lock held) Whether its copy need wait no longer."""

    def finish_wait(self) -> None:
        """(claimed, no lock held) Copy what is READY; sets ``served``."""

    def polls(self) -> bool:
        """(the set's lock held) Whether it awaits chunks only L2 may bring (``poll``)."""

    def poll(self) -> None:
        """(no lock held) Begin loading what L2 now holds of its awaited chunks."""


class WaitingRetrieves:
    """The retrieves waiting for their chunks to come from L2 (``EngineParts.waiting``).

    Guarded by ``EngineParts.loads_settled``, which every settled load and every stop
    notifies. Each op here also has a pass queued on (or running on) the retrieve waiter, so
    some pass is always waiting while an op is here; that pass serves every op whose chunks
    settled or whose deadline passed, in the order they settle, so one retrieve never waits
    behind another's loads. Each op is claimed once: the thread that claims it cuts and
    copies it. NOTE: a pass still brings in its own op's missing chunks (``_bring_in``) in
    queue order; an op whose lookup began its loads skips that.
    """

    def __init__(self, settled: threading.Condition) -> None:
        self._settled = settled
        self._ops: dict[WaitingOp, None] = {}  # insertion-ordered

    def add(self, op: WaitingOp) -> None:
        """(lock held) Wait for ``op``'s chunks from now on."""
        self._ops[op] = None
        self._settled.notify_all()  # a waiting pass looks at it now

    def discard(self, op: WaitingOp) -> None:
        """(lock held)"""
        self._ops.pop(op, None)

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
                    soonest = min((op.deadline for op in self._ops), default=own.deadline)
                    polling = [op for op in self._ops if op.polls()]
                    self._settled.wait(min(soonest.left(), AWAIT_POLL_S) if polling else soonest.left())
            for op in polling:  # outside the lock: a poll asks L2
                op.poll()
            for op in due:
                op.finish_wait()
        own.served.wait()  # claimed by another thread: it is copying it now

    def _take_due(self, forced: WaitingOp | None) -> list[WaitingOp]:
        now = time.monotonic()
        due = [op for op in self._ops if op is forced or now >= op.deadline.at or op.settled()]
        for op in due:
            del self._ops[op]
            op.claimed = True
        return due


def notify_settled(settled: threading.Condition) -> None:
    """Wake the retrieves waiting on ``settled`` (``EngineParts.loads_settled``): a load
    settled, or (the retrieve waiter's ``wake``) their ``stop`` was set."""
    with settled:
        settled.notify_all()


__all__ = ["WaitingOp", "WaitingRetrieves", "notify_settled"]
