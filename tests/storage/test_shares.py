"""TenantShares: room comes from the fullest tenant, never from one holding less than the asker.

The rule of L1 and of the disk tier: most tests here drive it through the L1 pool, whose
pins it counts; the disk tier's own (``tests/storage/l2/test_disk_tenants.py``) charge files
unpinned and ask before a write.
"""

from __future__ import annotations

import random
import time

import pytest

from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.pool import EntryState, L1Entry, L1Pool
from kvcache.storage.l1.s3fifo import S3FIFOPolicy
from kvcache.storage.l1.slab import SlotShape
from kvcache.storage.l2.base import EvictionPolicy
from kvcache.storage.shares import TenantShares
from tests.storage.l1.test_pool import G2, G, pool, write


def _held(shares: TenantShares, keys: dict[int, str], nbytes: int = 1) -> None:
    for key, tenant in keys.items():
        shares.charge(key, tenant, nbytes)
        shares.add(key)


@pytest.mark.parametrize("make", [LRUPolicy, S3FIFOPolicy])
@pytest.mark.parametrize("seed", range(10))
def test_one_tenant_is_its_policy_call_for_call(make: type[EvictionPolicy], seed: int) -> None:
    rng = random.Random(seed)
    shares, plain = TenantShares(make), make()
    charged: set[int] = set()
    for _ in range(400):
        key, op = rng.randrange(40), rng.randrange(5)
        if op == 0 and key not in charged:
            shares.charge(key, "t", 8)
            charged.add(key)
            shares.add(key)
            plain.add(key)
        elif op == 1:
            shares.touch(key)
            plain.touch(key)
        elif op == 2:
            keys = [rng.randrange(40) for _ in range(5)]
            shares.touch_many(keys)
            plain.touch_many(keys)
        elif op == 3 and key in charged:  # evicted or deleted
            shares.discard(key)
            plain.discard(key)
            shares.release(key, 8)
            charged.discard(key)
        elif op == 4 and (victim := plain.victim()) is not None:
            assert shares.victim_for("t") == (victim, "t") and shares.victim() == victim
        assert len(shares) == len(plain) and all((k in shares) == (k in plain) for k in range(40))


def test_room_comes_from_the_fullest_tenant_and_never_from_one_holding_less() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 3: "a", 10: "v", 11: "v"})
    assert shares.victim_for("a") == (1, "a")  # the asker is the fullest: it pays with its oldest
    assert shares.victim_for("v") == (1, "a")  # a fuller tenant pays for the one holding less
    assert shares.victim_for("new") == (1, "a") and shares.victim() == 1
    for key in (1, 2, 3):  # the fullest has nothing evictable just now (its copies in flight)
        shares.discard(key)
    assert shares.victim_for("a") == (None, None)  # it waits for its own or goes without
    assert shares.victim_for("v") == (10, "v")  # the one holding less may evict only its own
    assert shares.victim_for("v", "a") == (10, "v")  # nothing left of the one it began with
    assert shares.held() == {"a": 3, "v": 2}


def test_the_asker_pays_first_among_equals() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 10: "v", 11: "v"})
    assert shares.victim_for("a") == (1, "a")
    assert shares.victim_for("v") == (10, "v")
    assert shares.victim_for("a", "v") == (10, "v")  # an allocation goes on with whom it began


def test_a_tenant_holding_nothing_leaves_no_state_and_touches_keep_each_tenants_order() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 10: "v", 11: "v", 12: "v"})
    shares.touch_many([10, 1, 99, 11])  # an unknown key is ignored, as LRU does
    assert shares.victim_for("v")[0] == 12 and shares.victim_for("a")[0] == 12
    shares.discard(1)
    shares.discard(2)
    assert shares.victim_for("a")[0] == 12
    shares.release(1, 1)
    shares.release(2, 1)
    shares.release(2, 1)  # twice: no-op
    assert shares.held() == {"v": 3} and 1 not in shares and len(shares) == 3


def test_in_the_pool_a_flood_evicts_its_own_and_a_tenant_within_its_share_keeps_everything() -> None:
    p = pool(18, extent_chunks=3)
    small = list(range(1000, 1006))  # 6 chunks: within an equal share of 18 among three
    big = list(range(2000, 2012))  # 12 chunks: over it
    for keys, tenant in ((small, "v"), (big, "b")):
        res = p.begin_write(G, keys, tenant=tenant)
        assert res.failed == 0
        p.finish([e for _, e in res.new])
    for i in range(50):  # a flood of fresh chunks, far more than L1
        flood = [10_000 + 4 * i + j for j in range(4)]
        res = p.begin_write(G, flood, tenant="a")
        assert res.failed == 0
        p.finish([e for _, e in res.new])
        assert p.resident(small) == (len(small), 0), "the flood took the small tenant's chunks"
    held = p.info()["tenant_bytes"]
    # The one over its share gave back down to it; then the flood evicts its own (the asker
    # pays first among equals).
    assert held == {"v": 6 * G.stride, "b": 6 * G.stride, "a": 6 * G.stride}
    assert write(p, [1006, 1007, 1008]) == [0, 1, 2]  # the default tenant (library use) is one more
    held = p.info()["tenant_bytes"]  # a fourth tenant: the share is 18 / 4 chunks now
    assert (
        held[""] == 3 * G.stride and min(held.values()) >= 3 * G.stride and max(held.values()) <= 5 * G.stride
    )


def test_pins_that_could_give_room_are_waited_for_and_no_others() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 3: "a", 10: "b"})  # born pinned, then evictable (add) ...
    for tenant in ("a", "a", "a", "b"):
        shares.pinned(tenant, -1)  # ... once the write settled
    shares.pinned("b", 1)  # b's chunk is read
    assert not shares.room_may_come("a", 0)  # b holds less: its pin never gives a room
    assert shares.room_may_come("b", 0)  # its own pin will go
    assert not shares.room_may_come("b", 1)  # ... unless it is this reservation's own
    shares.pinned("a", 1)
    assert shares.room_may_come("a", 0) and shares.room_may_come("b", 0)


def test_the_askers_own_pins_are_counted_per_owner() -> None:
    """A retrieve's pinned prefix may hold chunks another tenant brought in (a shared salt):
    those pins never go while it waits either, so a count on its own chunks is not enough."""
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 3: "a", 10: "v", 11: "v"})  # born pinned: all five still are
    assert shares.room_may_come("v", 2)  # a's pins may give v room ...
    assert not shares.room_may_come("v", {"a": 3, "v": 2})  # ... unless they are all v's retrieve's
    assert shares.room_may_come("v", {"a": 2, "v": 2})  # one of a's is pinned by someone else
    assert not shares.room_may_come("a", {"a": 3})  # v holds less: its pins never give a room


def test_the_watermark_pass_after_a_write_is_on_the_writers_behalf() -> None:
    """A store with write-through to L2 still pins its chunks when it settles: the pass down
    to the watermark then took the other tenant's chunks (``victim()`` had no asker)."""
    p = L1Pool(10 * G.stride, watermark=0.9, extent_bytes=2 * G.stride)
    write_as(p, [1, 2], "v")
    for i in range(3):
        res = p.begin_write(G, [100 + 10 * i + j for j in range(3)], tenant="a")
        new = [e for _, e in res.new]
        p.pin(new)  # store._copied: pinned for the write to L2 before it settles
        p.finish(new)
        p.release(new)
        assert p.resident([1, 2]) == (2, 0), p.info()["tenant_bytes"]
    write_as(p, [3, 4, 5], "v")  # room from the fuller, then down to the watermark: equal shares
    assert p.info()["tenant_bytes"] == {"v": 4 * G.stride, "a": 5 * G.stride}  # the asker paid the tie


def test_a_tenant_within_its_share_never_pays_for_another_tenants_pins_over_the_watermark() -> None:
    """A flood's chunks pinned for their write to L2 may hold L1 above the watermark; the pass
    after a small tenant's own write evicted that tenant's chunks down to it (3 of 3 to 1)."""
    p = L1Pool(10 * G.stride, watermark=0.8, extent_bytes=2 * G.stride)  # equal share: 4 each
    write_as(p, [1, 2, 3], "a")
    res = p.begin_write(G, list(range(100, 107)), tenant="b")
    flood = [e for _, e in res.new]
    p.pin(flood)  # its write-through in flight
    p.finish(flood)
    write_as(p, [4], "a")  # L1 is full of pins: its slot is one of its own (it cannot wait)
    assert p.info()["tenant_bytes"]["a"] == 3 * G.stride, p.info()["tenant_bytes"]
    kept = [k for k in (1, 2, 3, 4) if k in p]
    p.release(flood)
    write_as(p, [5], "b")  # the flood's next write pays for its own excess
    assert [k for k in (1, 2, 3, 4) if k in p] == kept and p.used_bytes <= 8 * G.stride


def test_with_one_tenant_a_finish_with_nothing_written_still_evicts_to_the_watermark() -> None:
    """As before the shares: the pass runs after every settle, a failed or empty one too."""
    p = L1Pool(4 * G.stride, watermark=0.5, extent_bytes=2 * G.stride)
    res = p.begin_write(G, [1, 2, 3, 4])
    written = [e for _, e in res.new]
    p.pin(written)  # held for a write to L2: the pass after it can evict none
    p.finish(written)
    assert p.used_bytes == 4 * G.stride
    p.release(written)
    p.finish([])  # a settle of nothing (a store whose reservation got no fresh slot)
    assert p.used_bytes == 2 * G.stride  # the pass ran, down to the watermark


def test_a_writer_never_waits_for_pins_that_cannot_give_it_room() -> None:
    """The fuller tenant's write used to wait its whole bound for the pin of a tenant holding
    less (a read of its chunk), which it may never take, then fail."""
    p = L1Pool(10 * G.stride, watermark=1.0, extent_bytes=2 * G.stride)
    write_as(p, [1, 2, 3], "b")
    reading = p.acquire([1])
    started = time.monotonic()
    res = p.begin_write(G, list(range(100, 108)), wait_s=30.0, tenant="a")  # 8 chunks, 7 free
    assert time.monotonic() - started < 10 and len(res.new) == 7 and res.failed == 1
    p.release(reading)


def test_an_allocation_evicts_from_one_tenant_until_a_slot_of_another_shape_is_free() -> None:
    """A slot of another shape comes only from a wholly free extent: the victims must come
    from one slab until one is free, not stop as soon as that tenant holds less than the asker."""
    p = L1Pool(16 * G.stride, watermark=1.0, extent_bytes=4 * G.stride)  # 4 of G, 5 of G2 per extent
    write_as(p, list(range(100, 110)), "a", G2)  # 2 extents
    reading = p.acquire(list(range(100, 110)))  # all pinned by reads
    write_as(p, list(range(1, 9)), "b")  # 2 extents of G
    by_extent: dict[int, list[int]] = {}
    for k in range(1, 9):
        by_extent.setdefault(p.get(k)._extent, []).append(k)
    for k in [k for pair in zip(*by_extent.values(), strict=True) for k in pair]:
        p.prefix([k])  # its LRU order alternates between its extents
    res = p.begin_write(G2, [200], tenant="a")
    assert len(res.new) == 1 and res.failed == 0
    # b's victims came from b until one of its extents was whole (7 of 8 in this order)
    assert 0 < p.info()["tenant_bytes"]["b"] < 4 * G.stride
    p.release(reading)


def test_a_tenant_keeps_its_s3fifo_ghost_when_it_empties() -> None:
    shares = TenantShares(S3FIFOPolicy)
    _held(shares, {1: "t", 2: "t"})
    for key in (1, 2):
        shares.discard(key)
        shares.release(key, 1)
    assert shares.held() == {}
    _held(shares, {1: "t"})  # back from the ghost: straight to the main queue, as with one policy
    plain = S3FIFOPolicy()
    for key in (1, 2):
        plain.add(key)
        plain.discard(key)
    plain.add(1)
    assert shares.victim() == plain.victim()


def test_an_unpinned_charge_counts_its_bytes_and_no_pin() -> None:
    """A disk file: whole and evictable once added, never pinned."""
    shares = TenantShares(LRUPolicy)
    shares.charge(1, "d", 8, pinned=False)
    shares.add(1)
    assert shares.held() == {"d": 8} and shares.pinned_total() == 0
    assert shares.victim_for("d") == (1, "d") and not shares.room_may_come("d", 0)
    shares.discard(1)
    shares.release(1, 8)
    assert shares.held() == {} and shares.pinned_total() == 0


def test_asked_before_a_write_the_victim_is_the_one_that_write_would_evict() -> None:
    """``adding``: the writer is charged as if its write were in (the disk tier's admission
    weighs that victim), so a writer that would reach the fullest's bytes pays first."""
    shares = TenantShares(LRUPolicy)
    _held(shares, {10: "b", 11: "b", 12: "b"})
    assert shares.victim_for("new", adding=2) == (10, "b")  # one other tenant: not alone
    assert shares.victim_for("new", adding=4) == (None, None)  # only its own write could go
    assert shares.victim_for("b", adding=1) == (10, "b")
    _held(shares, {1: "a", 2: "a"})
    assert shares.victim_for("a") == (10, "b")  # a holds less now
    assert shares.victim_for("a", adding=1) == (1, "a")  # as much once written: it pays first
    assert shares.victim_for("c", adding=3) == (10, "b")  # as much as b, more than a
    assert shares.victim_for(None, adding=5) == (10, "b")  # no asker: the fullest


def test_a_policy_instance_is_refused_for_a_factory() -> None:
    with pytest.raises(TypeError, match="fresh EvictionPolicy"):
        L1Pool(G.stride, policy=LRUPolicy())  # type: ignore[arg-type]


def write_as(p: L1Pool, keys: list[int], tenant: str, shape: SlotShape = G) -> None:
    res = p.begin_write(shape, keys, tenant=tenant)
    assert res.failed == 0
    p.finish([e for _, e in res.new])


def _check_books(p: L1Pool) -> None:
    """The shares' books agree with the pool's: bytes, pins, evictable keys."""
    shares = p._policy
    held = shares.held()
    assert sum(held.values()) == p.used_bytes
    assert set(shares._tenant) == set(p._entries)
    assert sum(shares._pins.values()) == p._pinned
    evictable = {k for k, e in p._entries.items() if e.pins == 0 and e.state is EntryState.READY}
    assert len(shares) == len(evictable) and all(k in shares for k in evictable)
    per: dict[str, int] = {}
    for e in p._entries.values():
        per[e.tenant] = per.get(e.tenant, 0) + e.slot_shape.stride
    assert per == held


@pytest.mark.parametrize("make", [LRUPolicy, S3FIFOPolicy])
@pytest.mark.parametrize("seed", range(20))
def test_the_books_hold_through_any_sequence_of_pool_operations(
    make: type[EvictionPolicy], seed: int
) -> None:
    """Writes settled or failed, loads that fail while a reader joined them, pins, reads,
    evictions and clears, by 2 to 4 tenants of two slot shapes."""
    rng = random.Random(seed)
    p = L1Pool(12 * G.stride, watermark=rng.choice([0.7, 0.9, 1.0]), extent_bytes=2 * G.stride, policy=make)
    tenants = ["a", "b", "c", "d"][: rng.randint(2, 4)]
    writing: list[list[L1Entry]] = []
    loading: list[list[L1Entry]] = []
    pinned: list[list[L1Entry]] = []
    for _ in range(300):
        op, tenant, shape = rng.randrange(9), rng.choice(tenants), rng.choice([G, G, G2])
        keys = list(dict.fromkeys(rng.randrange(60) for _ in range(rng.randint(1, 5))))
        if op == 0:
            writing.append(
                [e for _, e in p.begin_write(shape, keys, partial=rng.random() < 0.5, tenant=tenant).new]
            )
        elif op == 1 and writing:
            entries = writing.pop(rng.randrange(len(writing)))
            oks = [rng.random() < 0.8 for _ in entries]
            if rng.random() < 0.3:  # pinned for a write to L2 before it settles
                pinned.append([e for e, ok in zip(entries, oks, strict=True) if ok])
                p.pin(pinned[-1])
            p.finish(entries, oks)
        elif op == 2:
            loading.append(p.begin_load(shape, [k for k in keys if p.get(k) is None], tenant=tenant))
        elif op == 3 and loading:
            entries = loading.pop(rng.randrange(len(loading)))
            p.finish(entries, [rng.random() < 0.7 for _ in entries])
        elif op == 4:
            pinned.append(p.acquire(keys))  # joins loads in flight too
        elif op == 5 and pinned:
            p.release(pinned.pop(rng.randrange(len(pinned))))
        elif op == 6 and rng.random() < 0.2:
            p.clear()
        elif op == 7:
            p.resident_many([keys, keys[:2]], shared=[0, min(2, len(keys))])
        elif op == 8:
            p.evict(keys)
        _check_books(p)
    for entries in writing:
        p.finish(entries)
    for entries in loading:
        p.finish(entries, False)
    for entries in pinned:
        p.release(entries)
    p.clear()
    _check_books(p)
    assert p.used_bytes == 0 and p._policy.held() == {} and sum(p._policy._pins.values()) == 0
