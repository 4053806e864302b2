"""LRUPolicy: order, touch, discard."""

from __future__ import annotations

from kvcache.storage.l1.lru import LRUPolicy


def test_victim_is_least_recently_used() -> None:
    p = LRUPolicy()
    assert p.victim() is None
    for k in (1, 2, 3):
        p.add(k)
    assert p.victim() == 1 and len(p) == 3
    p.touch(1)
    assert p.victim() == 2
    p.add(2)  # re-added = most recent
    assert p.victim() == 3
    p.discard(3)
    p.discard(99)
    p.touch(99)
    assert 3 not in p and 99 not in p and p.victim() == 1
