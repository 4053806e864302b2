"""The lanes' queue serves principals in turn: a backlog never runs ahead of a newcomer."""

from __future__ import annotations

import threading

from kvcache.server.fair_queue import FairQueue


def test_a_principal_with_a_backlog_is_served_in_turn_with_one_that_just_arrived() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(1000):
        q.put("flood", f"f{i}")
    q.put("victim", "v0")
    q.put("victim", "v1")
    order = [q.get() for _ in range(5)]
    assert order == ["f0", "v0", "f1", "v1", "f2"]  # a FIFO would give f0..f4
    assert len(q) == 997


def test_each_principal_keeps_its_own_arrival_order() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(6):
        q.put("a" if i % 3 else "b", i)
    got = [q.get() for _ in range(6)]
    assert [i for i in got if i % 3] == [1, 2, 4, 5]
    assert [i for i in got if not i % 3] == [0, 3]


def test_stop_lets_queued_items_be_served_first_then_releases_every_worker() -> None:
    q: FairQueue[int] = FairQueue()
    q.put("a", 1)
    q.stop()
    assert q.get() == 1
    assert q.get() is None
    released: list[int | None] = []
    workers = [threading.Thread(target=lambda: released.append(q.get())) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(5)
    assert released == [None, None, None]


def test_take_all_empties_every_principals_queue() -> None:
    q: FairQueue[int] = FairQueue()
    q.put("a", 1)
    q.put("b", 2)
    q.put("a", 3)
    assert sorted(q.take_all()) == [1, 2, 3]
    assert len(q) == 0
