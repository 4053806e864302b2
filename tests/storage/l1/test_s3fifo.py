"""Eviction policies against reference models (hypothesis drives random operation sequences),
and the property S3-FIFO exists for: a burst of one-hit keys does not evict a key in use."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.s3fifo import S3FIFOPolicy
from kvcache.storage.l2.base import EvictionPolicy


class RefLRU:
    """LRU as a plain list, oldest first."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def add(self, k: int) -> None:
        if k in self.order:
            self.order.remove(k)
        self.order.append(k)

    def touch(self, k: int) -> None:
        if k in self.order:
            self.add(k)

    def discard(self, k: int) -> None:
        if k in self.order:
            self.order.remove(k)

    def victim(self) -> int | None:
        return self.order[0] if self.order else None

    def tracked(self) -> set[int]:
        return set(self.order)


class RefS3FIFO:
    """S3-FIFO as the paper states it, on plain lists (small, main, ghost), with the contract's
    choices: a tracked key added again is a use, every discard goes to the ghost (bounded by
    max(64, keys tracked)), a key added from the ghost enters main, uses saturate at 3."""

    def __init__(self) -> None:
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[int] = []
        self.freq: dict[int, int] = {}

    def add(self, k: int) -> None:
        if k in self.freq:
            self.touch(k)
        elif k in self.ghost:
            self.ghost.remove(k)
            self.main.append(k)
            self.freq[k] = 0
        else:
            self.small.append(k)
            self.freq[k] = 0

    def touch(self, k: int) -> None:
        if k in self.freq:
            self.freq[k] = min(3, self.freq[k] + 1)

    def discard(self, k: int) -> None:
        if k not in self.freq:
            return
        del self.freq[k]
        (self.small if k in self.small else self.main).remove(k)
        if k in self.ghost:
            self.ghost.remove(k)
        self.ghost.append(k)
        self.ghost = self.ghost[max(0, len(self.ghost) - max(64, len(self.freq))) :]

    def victim(self) -> int | None:
        while self.small or self.main:
            total = len(self.small) + len(self.main)
            if self.small and (not self.main or len(self.small) > 0.1 * total):
                k = self.small[0]
                if self.freq[k] == 0:
                    return k
                self.small.pop(0)
                self.main.append(k)
                self.freq[k] = 0
            else:
                k = self.main[0]
                if self.freq[k] == 0:
                    return k
                self.freq[k] -= 1
                self.main.append(self.main.pop(0))
        return None

    def tracked(self) -> set[int]:
        return set(self.freq)


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "touch", "discard", "evict"]), st.integers(0, 40)),
    max_size=300,
)


def _replay(policy: EvictionPolicy, ref: RefLRU | RefS3FIFO, ops: list[tuple[str, int]]) -> None:
    for op, key in ops:
        if op == "evict":
            v = policy.victim()
            assert v == ref.victim()
            if v is not None:
                policy.discard(v)
                ref.discard(v)
        else:
            getattr(policy, op)(key)
            getattr(ref, op)(key)
        assert len(policy) == len(ref.tracked())
        assert all(k in policy for k in ref.tracked())
        assert policy.victim() == ref.victim()


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lru_matches_its_reference_model(ops: list[tuple[str, int]]) -> None:
    _replay(LRUPolicy(), RefLRU(), ops)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_s3fifo_matches_its_reference_model(ops: list[tuple[str, int]]) -> None:
    policy, ref = S3FIFOPolicy(), RefS3FIFO()
    _replay(policy, ref, ops)
    assert policy.queues() == (ref.small, ref.main, ref.ghost)


def test_the_reference_model_catches_a_wrong_policy() -> None:
    """Control: a policy that evicts newest-first (a plausible bug) is caught by the replay."""

    class Backwards(S3FIFOPolicy):
        def victim(self) -> int | None:
            small, main, _ = self.queues()
            keys = small + main
            return keys[-1] if keys else None

    try:
        _replay(Backwards(), RefS3FIFO(), [("add", 1), ("add", 2), ("evict", 0)])
    except AssertionError:
        return
    raise AssertionError("the replay did not tell a wrong victim from the right one")


def _survives_a_scan(make: Callable[[], EvictionPolicy]) -> bool:
    """A cache of 10 keys: key 0 is used between every few new one-hit keys; does it stay?"""
    p, resident, cap = make(), set(), 10
    for k in range(1, 10):
        p.add(k)
        resident.add(k)
    p.add(0)
    resident.add(0)
    p.touch(0)
    for k in range(100, 160):  # 60 one-hit keys, key 0 used after every 15
        p.add(k)
        resident.add(k)
        while len(resident) > cap:
            v = p.victim()
            assert v is not None
            p.discard(v)
            resident.discard(v)
        if k % 15 == 0 and 0 in resident:
            p.touch(0)
    return 0 in resident


def test_s3fifo_keeps_a_reused_key_through_a_burst_of_one_hit_keys_lru_does_not() -> None:
    assert _survives_a_scan(S3FIFOPolicy)
    assert not _survives_a_scan(LRUPolicy)
