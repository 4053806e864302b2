"""The waiting retrieves are indexed by the chunk each waits on: a wake-up costs O(woken).

Before, every settled load and every finished store looked at every waiting retrieve: with
15,000 retrieves awaiting a chunk nobody stores, each store of another tenant cost 15,000
checks under the engine's lock, and the daemon sat at 100 % CPU. These tests count the
checks (``settled`` calls) with fake ops, so they fail on a whole-set scan whatever the
machine's speed.
"""

from __future__ import annotations

import threading

from kvcache.deadline import Deadline
from kvcache.engine.waiting import WaitingRetrieves, notify_settled
from kvcache.records import ChunkKey


class FakeOp:
    """Waits on ``key`` until ``ready`` is set; counts how often it was checked."""

    def __init__(self, key: ChunkKey, seconds: float = 60.0) -> None:
        self.deadline = Deadline.within(seconds)
        self.claimed = False
        self.served = threading.Event()
        self.key = key
        self.ready = False
        self.checks = 0
        self.copied = False

    def settled(self) -> bool:
        self.checks += 1
        return self.ready

    def waits_on(self) -> ChunkKey | None:
        return self.key

    def finish_wait(self) -> None:
        self.copied = True
        self.served.set()

    def polls(self) -> bool:
        return False

    def poll(self) -> None:
        raise AssertionError("never polled: no L2")


def _never_hand_over(_stop: threading.Event) -> bool:
    return False


def _serve(waiting: WaitingRetrieves, own: FakeOp) -> None:
    waiting.serve(own, threading.Event(), _never_hand_over)


def test_a_settled_chunk_checks_only_the_retrieves_waiting_on_it() -> None:
    lock = threading.Condition()
    waiting = WaitingRetrieves(lock)
    flood = [FakeOp(key=1) for _ in range(2000)]
    mine = FakeOp(key=2)
    with lock:
        for op in [*flood, mine]:
            waiting.add(op)
    server = threading.Thread(target=_serve, args=(waiting, mine))
    server.start()
    try:
        with lock:  # the first pass checked each op once, then indexed it under its key
            while any(op.checks == 0 for op in [*flood, mine]):
                lock.wait(1)
        before = sum(op.checks for op in flood)
        mine.ready = True
        notify_settled(lock, [2], waiting)
        assert mine.served.wait(10)
        assert mine.copied
        assert sum(op.checks for op in flood) == before  # a whole-set scan would add 2000
        assert len(waiting) == len(flood)
    finally:
        server.join(10)


def test_a_retrieve_past_its_deadline_is_answered_though_nothing_woke_it() -> None:
    lock = threading.Condition()
    waiting = WaitingRetrieves(lock)
    flood = [FakeOp(key=1) for _ in range(500)]
    short = FakeOp(key=3, seconds=0.2)
    with lock:
        for op in [*flood, short]:
            waiting.add(op)
    server = threading.Thread(target=_serve, args=(waiting, short))
    server.start()
    assert short.served.wait(10) and short.copied and not short.ready
    server.join(10)
    assert not any(op.copied for op in flood)


def test_a_discarded_retrieve_is_forgotten_by_the_index() -> None:
    lock = threading.Condition()
    waiting = WaitingRetrieves(lock)
    gone, stays = FakeOp(key=5), FakeOp(key=5)
    with lock:
        waiting.add(gone)
        waiting.add(stays)
    server = threading.Thread(target=_serve, args=(waiting, stays))
    server.start()
    try:
        with lock:
            while not (gone.checks and stays.checks):
                lock.wait(1)
            waiting.discard(gone)
        gone.ready = stays.ready = True
        notify_settled(lock, [5], waiting)
        assert stays.served.wait(10)
        assert not gone.copied and len(waiting) == 0
    finally:
        server.join(10)


def test_retrieves_served_before_their_deadline_do_not_stay_in_the_deadline_heap() -> None:
    """Served early, an op's heap entry would otherwise be kept (with the op, its keys and
    block ids) until its deadline, up to the retrieve wait bound."""
    lock = threading.Condition()
    waiting = WaitingRetrieves(lock)
    ops = [FakeOp(key=i) for i in range(1000)]
    with lock:
        for op in ops:
            op.ready = True
            waiting.add(op)
        due = waiting._take_due(None)
    assert len(due) == 1000 and len(waiting) == 0
    assert len(waiting._deadlines) <= 64
