"""Which principals' copies give way: the one copying more than another active principal.

The lanes' accounts (a fake clock) say who is active; each principal's copies are charged in
bytes, as its caches' handlers charge them."""

from __future__ import annotations

from kvcache.server.copy_share import CopyShares
from kvcache.server.fair_queue import FairQueue, FairShare


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _shares() -> tuple[FairQueue[str], CopyShares, Clock]:
    clock = Clock()
    share = FairShare(in_flight=8, clock=clock, linger_s=0.01)
    return FairQueue(share), CopyShares(share), clock


def test_a_principal_copying_more_than_an_active_one_gives_way_alone_it_does_not() -> None:
    q, shares, clock = _shares()
    flood, victim = shares.principal("flood"), shares.principal("victim")
    q.put("flood", "f0")
    flood.charge(64 << 20)
    assert not flood.gives_way()  # alone: nobody to give way to
    q.put("victim", "v0")  # active, copying nothing yet: the flood gives way (its think time too)
    assert flood.gives_way() and not victim.gives_way()
    victim.charge(1 << 20)
    assert flood.gives_way() and not victim.gives_way()
    victim.charge(-(1 << 20))
    got = [q.get(), q.get()]
    for item in got:
        assert item is not None
        if item[0] == "v0":
            item[1].end()
    assert flood.gives_way()  # the victim lingers after its reply
    clock.now += 0.02  # its linger ends: checked against the clock, nothing else happened
    assert not flood.gives_way()


def test_one_huge_request_against_one_small_is_not_a_tie() -> None:
    """By bytes, not requests: a flood pacing itself to one store of 64 MiB in service still
    gives way to a client's one retrieve of 1 MiB."""
    q, shares, _ = _shares()
    flood, victim = shares.principal("flood"), shares.principal("victim")
    q.put("flood", "f0")
    q.put("victim", "v0")
    flood.charge(64 << 20)
    victim.charge(1 << 20)
    assert flood.gives_way() and not victim.gives_way()
    flood.charge(-(63 << 20))  # now equal: neither gives way
    assert not flood.gives_way() and not victim.gives_way()


def test_a_third_principals_think_time_does_not_lower_the_light_one_with_the_flood() -> None:
    q, shares, _ = _shares()
    flood, victim, idle = shares.principal("flood"), shares.principal("victim"), shares.principal("idle")
    for name in ("flood", "victim", "idle"):
        q.put(name, name)
    flood.charge(64 << 20)
    victim.charge(1 << 20)
    assert flood.gives_way() and not victim.gives_way() and not idle.gives_way()


def test_copying_that_is_not_active_on_the_lanes_counts_for_nothing() -> None:
    """An awaiting retrieve's slot ends while it waits; its copy later is still charged, and
    a principal that is not active (no request, no linger) is nobody to give way to."""
    q, shares, _ = _shares()
    flood, gone = shares.principal("flood"), shares.principal("gone")
    q.put("flood", "f0")
    flood.charge(64 << 20)
    gone.charge(1 << 20)  # charged, but never on the lanes: not active
    assert not flood.gives_way()
