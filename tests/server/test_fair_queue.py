"""The lanes' queue shares the daemon between principals by the service each used.

A fake clock charges each request exactly the service the test says it took, so the order
the queue hands work out in is a fact the test can state; blocking is checked with a worker
thread that must (or must not) come back."""

from __future__ import annotations

import threading

import pytest

from kvcache.server.fair_queue import FairQueue, FairShare, Slot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _queue(clock: Clock, **kw: float) -> tuple[FairQueue[str], FairShare]:
    opts = {"in_flight": 8, "slice_s": 0.0, "bonus_s": 0.05, "linger_s": 0.01, **kw}
    share = FairShare(clock=clock, **opts)  # type: ignore[arg-type]
    return FairQueue(share), share


def _serve(q: FairQueue[str], clock: Clock, n: int, service_s: float) -> list[str]:
    """Take ``n`` items one at a time, each in service for ``service_s``."""
    out = []
    for _ in range(n):
        got = q.get()
        assert got is not None
        item, slot = got
        clock.now += service_s
        slot.end()
        out.append(item)
    return out


def _get_in_thread(q: FairQueue[str]) -> tuple[threading.Thread, list[tuple[str, Slot] | None]]:
    box: list[tuple[str, Slot] | None] = []
    t = threading.Thread(target=lambda: box.append(q.get()), daemon=True)
    t.start()
    return t, box


def test_principals_that_used_the_same_are_served_in_turn() -> None:
    clock = Clock()
    q, _ = _queue(clock)
    for i in range(1000):
        q.put("flood", f"f{i}")
    q.put("victim", "v0")
    q.put("victim", "v1")
    assert _serve(q, clock, 5, 0.0) == ["f0", "v0", "f1", "v1", "f2"]  # a FIFO would give f0..f4
    assert len(q) == 997


def test_a_principal_that_used_more_waits_while_a_lighter_one_is_active() -> None:
    clock = Clock()
    q, share = _queue(clock)
    for i in range(100):
        q.put("flood", f"f{i}")
    assert _serve(q, clock, 20, 0.01) == [f"f{i}" for i in range(20)]  # 0.2 s of service
    for i in range(3):
        q.put("victim", f"v{i}")
    # The flood is first in turn and has 80 queued; the victim still goes first, and alone.
    assert _serve(q, clock, 3, 0.001) == ["v0", "v1", "v2"]
    # Its client thinks between two requests (the linger): the flood does not start meanwhile.
    worker, box = _get_in_thread(q)
    worker.join(0.3)
    assert worker.is_alive() and not box, "the flood started while the victim was still active"
    clock.now += 0.02  # past the linger: the victim is idle, the flood goes on
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "f20"
    assert share.vtime("victim") < share.vtime("flood")


def test_requests_held_in_service_are_charged_while_they_are_held() -> None:
    """A principal that keeps a request in service for long (a store waiting for L1 room,
    say) is charged as it holds it: charged only at the end, it stayed the least-served
    and held every other principal off until then."""
    clock = Clock()
    q, _ = _queue(clock, bonus_s=0.0)
    q.put("holder", "h0")
    held = q.get()  # in service, and it will not end during this test
    assert held is not None
    q.put("other", "o0")
    q.put("other", "o1")
    assert _serve(q, clock, 1, 0.5) == ["o0"]  # the other used 0.5 s; the holder held 0.5 s ...
    clock.now += 0.1  # ... and holds on: past its grace, it has used more than the other now
    worker, box = _get_in_thread(q)
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "o1", "the holder's request held the other off"


def test_idle_time_is_not_banked() -> None:
    """A principal back from idling gets at most ``bonus_s`` of service ahead of the busiest
    one, not the service it could have used while away."""
    clock = Clock()
    q, _ = _queue(clock, bonus_s=0.05)
    q.put("sleeper", "s-1")
    _serve(q, clock, 1, 0.001)
    clock.now += 3600  # an hour idle, while ...
    for i in range(2000):
        q.put("flood", f"f{i}")
    _serve(q, clock, 1000, 0.01)  # ... the flood used 10 s
    for i in range(20):
        q.put("sleeper", f"s{i}")
    order = _serve(q, clock, 12, 0.01)
    assert order[:5] == ["s0", "s1", "s2", "s3", "s4"]  # its bonus: 0.05 s, five requests
    assert "f1000" in order[5:8], order  # then the two share again


def test_a_principal_alone_gets_every_slot_and_with_others_its_share() -> None:
    clock = Clock()
    q, _ = _queue(clock, in_flight=8)
    for i in range(20):
        q.put("flood", f"f{i}")
    slots = []
    for _ in range(8):
        got = q.get()
        assert got is not None
        slots.append(got[1])
    worker, box = _get_in_thread(q)  # a ninth: over what even a lone principal may run
    worker.join(0.3)
    assert worker.is_alive() and not box
    q.put("victim", "v0")  # two active now: the flood holds 8 of its share of 4, the victim 0
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "v0"
    worker, box = _get_in_thread(q)
    worker.join(0.3)
    assert worker.is_alive(), "the flood started a ninth while over its share"
    for slot in slots[:5]:  # back under its share (3 of 4)
        slot.end()
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "f8"


def test_an_ended_slot_is_charged_once() -> None:
    clock = Clock()
    q, share = _queue(clock)
    q.put("a", "a0")
    before = share.vtime("a")
    got = q.get()
    assert got is not None
    clock.now += 0.5
    got[1].end()
    got[1].end()
    assert share.vtime("a") - before == pytest.approx(0.5)


def test_the_owner_table_forgets_idle_principals() -> None:
    clock = Clock()
    q, share = _queue(clock)
    for i in range(500):
        q.put(f"p{i}", "x")
        _serve(q, clock, 1, 0.0)
        clock.now += 1.0  # each idle past the linger before the next comes
    assert len(share._owners) <= 65


def test_each_principal_keeps_its_own_arrival_order() -> None:
    clock = Clock()
    q, _ = _queue(clock)
    for i in range(6):
        q.put("a" if i % 3 else "b", str(i))
    got = _serve(q, clock, 6, 0.0)
    assert [i for i in got if int(i) % 3] == ["1", "2", "4", "5"]
    assert [i for i in got if not int(i) % 3] == ["0", "3"]


def test_stop_lets_queued_items_be_served_first_then_releases_every_worker() -> None:
    q, _ = _queue(Clock())
    q.put("a", "1")
    q.stop()
    got = q.get()
    assert got is not None and got[0] == "1"
    got[1].end()
    assert q.get() is None
    released: list[object] = []
    workers = [threading.Thread(target=lambda: released.append(q.get())) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(5)
    assert released == [None, None, None]


def test_take_all_empties_every_principals_queue_and_frees_their_accounts() -> None:
    clock = Clock()
    q, _ = _queue(clock)
    q.put("a", "1")
    q.put("b", "2")
    q.put("a", "3")
    assert sorted(q.take_all()) == ["1", "2", "3"]
    assert len(q) == 0
    clock.now += 1.0
    q.put("c", "4")  # a and b are idle: c is alone and starts at once
    assert _serve(q, clock, 1, 0.0) == ["4"]


def test_two_lanes_share_one_account() -> None:
    """A flood on the fast lane (lookups) yields to another principal's bulk work too."""
    clock = Clock()
    share = FairShare(clock=clock, in_flight=8, slice_s=0.0, bonus_s=0.05, linger_s=0.01)
    fast: FairQueue[str] = FairQueue(share)
    bulk: FairQueue[str] = FairQueue(share)
    for i in range(50):
        fast.put("flood", f"l{i}")
    _serve(fast, clock, 10, 0.01)
    bulk.put("victim", "r0")
    worker, box = _get_in_thread(fast)
    worker.join(0.3)
    assert worker.is_alive(), "the fast lane's flood started while the victim's retrieve waited"
    assert _serve(bulk, clock, 1, 0.001) == ["r0"]
    clock.now += 0.02
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "l10"


def test_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="in_flight"):
        FairShare(in_flight=0)


def test_a_worker_idle_before_a_blocked_put_still_starts_it_when_the_linger_ends() -> None:
    """A put that may not start yet wakes no worker, unless only time will let it start: then
    one worker must wait with a timeout, or the request waits for some unrelated event."""
    clock = Clock()
    q, _ = _queue(clock, linger_s=0.2)
    for i in range(3):
        q.put("flood", f"w{i}")
    _serve(q, clock, 3, 0.05)  # the flood used 0.15 s alone
    clock.now += 0.3  # and is idle past its linger
    q.put("victim", "v1")
    _serve(q, clock, 1, 0.001)  # the victim is active again (lingering), the least-served
    worker, box = _get_in_thread(q)  # idle: nothing queued, it waits without a timeout
    worker.join(0.2)
    assert worker.is_alive()
    q.put("flood", "f0")  # may not start while the victim lingers: only time lets it
    clock.now += 0.3  # the linger ends; no other event follows
    worker.join(10)
    assert box and box[0] is not None and box[0][0] == "f0", "the blocked put was never started"


def test_active_is_a_lock_free_view_that_a_linger_leaves_on_time() -> None:
    """``active`` (read by copy threads without the lock): principals with requests queued
    or in service, and those within their linger; an ended linger is never stale."""
    clock = Clock()
    q, share = _queue(clock)
    assert share.active(clock.now) == []
    q.put("flood", "f0")
    q.put("victim", "v0")
    assert sorted(share.active(clock.now)) == ["flood", "victim"]
    got = q.get()
    assert got is not None and sorted(share.active(clock.now)) == ["flood", "victim"]  # in service
    clock.now += 0.001
    got[1].end()
    assert sorted(share.active(clock.now)) == ["flood", "victim"]  # one queued, one lingering
    later = clock.now + 0.02  # past the linger, with no call on the share in between
    assert share.active(later) == ["flood" if got[0] == "v0" else "victim"]


def test_backlogged_names_the_principals_the_lanes_hold_back() -> None:
    """``backlogged`` (read by copy threads without the lock): principals with requests queued
    that ``may_start`` found over their share or ahead of a lighter one; not those whose
    requests only wait for a worker to take them."""
    clock = Clock()
    q, share = _queue(clock, in_flight=2)
    q.put("flood", "f0")
    q.put("flood", "f1")
    q.put("flood", "f2")
    assert share.backlogged() == frozenset()  # alone, within its share: waiting for a worker
    first = [q.get(), q.get()]  # its share of 2 in service
    q.put("flood", "f3")
    assert share.backlogged() == {"flood"}  # over its share
    q.put("victim", "v0")
    assert share.backlogged() == {"flood"}  # the victim may start: not held back
    got = q.get()
    assert got is not None and got[0] == "v0" and share.backlogged() == {"flood"}
    for item in (*first, got):
        assert item is not None
        clock.now += 0.001
        item[1].end()
    clock.now += 0.02  # the victim's linger over: the flood alone again
    got = q.get()
    assert got is not None and got[0] == "f2" and share.backlogged() == frozenset()
    assert len(q.take_all()) == 1 and share.backlogged() == frozenset()


def test_others_active_says_whether_a_principal_besides_one_is_active() -> None:
    clock = Clock()
    q, share = _queue(clock)
    assert not share.others_active(None, clock.now)
    q.put("a", "a0")
    assert share.others_active(None, clock.now) and share.others_active("flood", clock.now)
    assert not share.others_active("a", clock.now)  # a alone
    q.put("b", "b0")
    assert share.others_active("a", clock.now) and share.others_active("b", clock.now)
    for _ in range(2):
        got = q.get()
        assert got is not None
        got[1].end()
    assert share.others_active("a", clock.now)  # b lingers
    assert not share.others_active("flood", clock.now + 0.02)  # both lingers over
