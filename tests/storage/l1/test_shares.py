"""TenantShares: room comes from the fullest tenant, never from one holding less than the asker."""

from __future__ import annotations

import random

import pytest

from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.s3fifo import S3FIFOPolicy
from kvcache.storage.l1.shares import TenantShares
from kvcache.storage.l2.base import EvictionPolicy
from tests.storage.l1.test_pool import G, pool, write


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
            assert shares.victim_for("t") == victim == shares.victim()
        assert len(shares) == len(plain) and all((k in shares) == (k in plain) for k in range(40))


def test_room_comes_from_the_fullest_tenant_and_never_from_one_holding_less() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 3: "a", 10: "v", 11: "v"})
    assert shares.victim_for("a") == 1  # the asker is the fullest: it pays with its oldest
    assert shares.victim_for("v") == 1  # a fuller tenant pays for the one holding less
    assert shares.victim_for("new") == 1 and shares.victim() == 1
    for key in (1, 2, 3):  # the fullest has nothing evictable just now (its copies in flight)
        shares.discard(key)
    assert shares.victim_for("a") is None  # it waits for its own or goes without
    assert shares.victim_for("v") == 10  # the one holding less may evict only its own
    assert shares.held() == {"a": 3, "v": 2}


def test_the_asker_pays_first_among_equals() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 10: "v", 11: "v"})
    assert shares.victim_for("a") == 1
    assert shares.victim_for("v") == 10


def test_a_tenant_holding_nothing_leaves_no_state_and_touches_keep_each_tenants_order() -> None:
    shares = TenantShares(LRUPolicy)
    _held(shares, {1: "a", 2: "a", 10: "v", 11: "v", 12: "v"})
    shares.touch_many([10, 1, 99, 11])  # an unknown key is ignored, as LRU does
    assert shares.victim_for("v") == 12 and shares.victim_for("a") == 12
    shares.discard(1)
    shares.discard(2)
    assert shares.victim_for("a") == 12
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
