"""A worker lane's queue: one FIFO per principal, served one request per principal in turn.

Apart from the loop (``daemon``) because it is one rule about sharing, not about sockets:
the lanes' worker threads are the daemon's to share, and a plain FIFO lets whoever queues
most take them all. A tenant that pipelines 20,000 retrieves put every other tenant's
request behind its whole backlog (an L1 hit took 10 s instead of 4 ms). Here the workers
take one request from each principal with work in turn (round robin), so another
principal's request waits for at most one request of each principal ahead of it in the
turn, plus the ones already running, however deep any backlog is. Within a principal the
order is its arrival order, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """A blocking multi-producer, multi-consumer queue, fair across owners; thread-safe.

    ``get`` returns None (a worker's cue to leave) only once the queue is empty and
    ``stop`` was called: requests queued before the stop are still served, as with a FIFO
    and a sentinel put last."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._by_owner: dict[str, deque[T]] = {}  # insertion order: the turn order
        self._len = 0
        self._stopped = False

    def __len__(self) -> int:
        with self._cv:
            return self._len

    def put(self, owner: str, item: T) -> None:
        with self._cv:
            self._by_owner.setdefault(owner, deque()).append(item)
            self._len += 1
            self._cv.notify()

    def get(self) -> T | None:
        """The oldest item of the owner whose turn it is (that owner goes to the back), or
        None once stopped and empty. Blocks while empty."""
        with self._cv:
            while not self._len:
                if self._stopped:
                    return None
                self._cv.wait()
            owner = next(iter(self._by_owner))
            items = self._by_owner.pop(owner)
            item = items.popleft()
            if items:
                self._by_owner[owner] = items  # re-inserted: last in turn
            self._len -= 1
            return item

    def take_all(self) -> list[T]:
        """Remove and return every queued item (a draining daemon refuses them)."""
        with self._cv:
            out = [item for items in self._by_owner.values() for item in items]
            self._by_owner.clear()
            self._len = 0
            return out

    def stop(self) -> None:
        """Let every ``get`` return None once the queue is empty (idempotent)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


__all__ = ["FairQueue"]
