"""L1Pool: slots, LRU at the watermark, pinned entries never evicted, exhaustion, events."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvcache.observability.event import EventType, L1Cleared, L1ReadFinished
from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.pool import EntryState, L1Entry, L1Pool, SlotShape, WriteReservation
from tests.helpers import RecordingSink as Sink

G = SlotShape((2, 2, 16, 64), torch.bfloat16)  # 8 KiB per chunk
G2 = SlotShape((1, 3, 16, 32), torch.float32)  # 6 KiB per chunk


def pool(chunks: int, watermark: float = 1.0, sink: Sink | None = None, extent_chunks: int = 2) -> L1Pool:
    return L1Pool(chunks * G.stride, watermark=watermark, extent_bytes=extent_chunks * G.stride, bus=sink)


def write(p: L1Pool, keys: list[int], geometry: SlotShape = G) -> list[int]:
    res = p.begin_write(geometry, keys)
    for _, e in res.new:
        e.tensor.fill_(e.key)
    p.finish([e for _, e in res.new])
    return [i for i, _ in res.new]


def test_slots_are_aligned_views_and_lazy() -> None:
    p = pool(8)
    assert p.allocated_bytes == 0
    res = p.begin_write(G, [1, 2, 3])
    assert [i for i, _ in res.new] == [0, 1, 2] and res.failed == 0
    ptrs = {e.tensor.data_ptr() for _, e in res.new}
    assert len(ptrs) == 3 and all(ptr % 256 == 0 for ptr in ptrs)
    assert all(e.tensor.shape == G.shape and e.tensor.dtype == G.dtype for _, e in res.new)
    assert all(e.state is EntryState.WRITING for _, e in res.new)
    assert p.prefix([1, 2, 3]) == 0  # not visible while being written
    p.finish([e for _, e in res.new])
    assert p.prefix([1, 2, 3, 4]) == 3 and 1 in p
    assert p.allocated_bytes == 4 * G.stride  # two extents of two slots
    assert p.used_bytes == 3 * G.stride


def test_present_keys_are_skipped() -> None:
    p = pool(8)
    write(p, [1, 2])
    res = p.begin_write(G, [1, 2, 3])
    assert res.present == [0, 1] and [i for i, _ in res.new] == [2]
    p.finish([e for _, e in res.new])


def test_lru_order_and_watermark() -> None:
    sink = Sink()
    p = pool(8, watermark=0.5, sink=sink)
    for k in (1, 2, 3, 4):
        write(p, [k])
    assert len(p) == 4 and not sink.of(EventType.L1_KEYS_EVICTED)
    assert p.prefix([1]) == 1  # touch 1: now 2 is the oldest
    write(p, [5])
    assert len(p) == 4 and p.used_bytes <= 4 * G.stride
    ev = sink.of(EventType.L1_KEYS_EVICTED)
    assert ev[-1].metadata.keys == [2]
    assert ev[-1].metadata.num_bytes == G.nbytes
    assert ev[-1].metadata.capacity_bytes == 8 * G.stride
    assert 2 not in p and 1 in p


def test_evicts_when_full_and_reuses_slots() -> None:
    p = pool(4)
    write(p, [1, 2, 3, 4])  # one prompt: its tail (4, then 3) is the least recently used
    assert write(p, [5, 6]) == [0, 1]
    assert [k for k in (1, 2, 3, 4, 5, 6) if k in p] == [1, 2, 5, 6]
    assert p.allocated_bytes == 4 * G.stride
    e = p.get(5)
    assert e is not None and torch.all(e.tensor == 5)


def test_prefix_head_outlives_its_tail() -> None:
    p = pool(4)
    write(p, [1, 2, 3])
    assert p.prefix([1, 2, 3]) == 3  # a lookup hit keeps the head most recent too
    write(p, [9, 8])
    assert [k for k in (1, 2, 3) if k in p] == [1, 2]
    held = p.acquire([1, 2])
    p.release(held)
    write(p, [7])
    assert 1 in p and 2 in p


def test_pinned_entries_are_never_evicted() -> None:
    sink = Sink()
    p = pool(4, sink=sink)
    write(p, [1, 2, 3, 4])
    held = p.acquire([1, 2, 3])
    assert [e.key for e in held] == [1, 2, 3]
    assert write(p, [5]) == [0]  # evicts 4, the only unpinned one
    assert 4 not in p and all(k in p for k in (1, 2, 3))
    res = p.begin_write(G, [6, 7])  # nothing evictable: 5 is... evictable, 6 fits, 7 fails
    assert [i for i, _ in res.new] == [0] and res.failed == 1
    p.finish([e for _, e in res.new])
    failed = sink.of(EventType.L1_ALLOCATION_FAILED)
    assert failed and failed[-1].metadata.requested_chunks == 1
    assert p.allocation_failures == 1
    p.release(held, read_bytes=3 * G.nbytes)
    read = L1ReadFinished(keys=[1, 2, 3], num_bytes=3 * G.nbytes)
    assert sink.of(EventType.L1_READ_FINISHED)[-1].metadata == read
    assert write(p, [8]) == [0]  # now 1 (oldest after release order) can go


def test_a_write_reports_the_present_entries_still_loading_and_can_watch_them() -> None:
    p = pool(8)
    write(p, [1])
    loads = p.begin_load(G, [2, 3])
    other = p.begin_write(G, [4])
    res = p.begin_write(G, [1, 2, 3, 4, 5])
    assert res.present == [0, 1, 2, 3] and [i for i, _ in res.new] == [4]
    assert [(i, e.key) for i, e in res.loading] == [(1, 2), (2, 3)]  # not 4: another write's
    seen: list[tuple[int, bool, EntryState | None]] = []

    def watcher(entry: L1Entry) -> None:  # runs with the lock dropped: the pool answers
        seen.append((entry.key, entry.ok, p.get(entry.key) and p.get(entry.key).state))  # type: ignore[union-attr]

    p.on_settled([e for _, e in res.loading] + [e for _, e in other.new], watcher)
    assert not seen
    p.finish([loads[0]], True)
    p.finish([loads[1]], False)
    p.finish([e for _, e in other.new], False)
    assert seen == [(2, True, EntryState.READY), (3, False, None), (4, False, None)]
    p.on_settled([loads[1]], watcher)  # settled already: called at once
    assert seen[-1] == (3, False, None)
    p.finish([e for _, e in res.new])


def test_writing_and_loading_entries_are_not_evicted() -> None:
    p = pool(2)
    res = p.begin_write(G, [1])
    loads = p.begin_load(G, [2])
    assert len(loads) == 1 and loads[0].state is EntryState.LOADING
    res2 = p.begin_write(G, [3])
    assert res2.failed == 1 and not res2.new  # everything in flight
    assert p.prefix([2]) == 1  # a loading entry counts for lookup
    p.finish([e for _, e in res.new])
    p.finish(loads, False)  # failed load: dropped, waiters see failure
    assert not loads[0].wait(0) and 2 not in p
    assert p.used_bytes == G.stride


def test_begin_load_stops_at_present_key() -> None:
    p = pool(8)
    write(p, [2])
    loads = p.begin_load(G, [1, 2, 3])
    assert [e.key for e in loads] == [1]
    p.finish(loads, True)
    assert loads[0].wait(0) and 1 in p


def test_two_geometries_share_the_budget() -> None:
    p = L1Pool(4 * G.stride, watermark=1.0, extent_bytes=G.stride)
    write(p, [1, 2, 3, 4])
    assert write(p, [10, 11], geometry=G2) == [0, 1]  # evicts G entries, releases their extents
    assert p.allocated_bytes <= 4 * G.stride
    assert 10 in p and 11 in p
    assert sum(k in p for k in (1, 2, 3, 4)) >= 2
    assert p.get(10).tensor.dtype == torch.float32  # type: ignore[union-attr]


def test_exhaustion_when_all_pinned() -> None:
    sink = Sink()
    p = pool(2, sink=sink)
    res = p.begin_write(G, [1, 2, 3, 4])
    assert len(res.new) == 2 and res.failed == 2
    assert sink.of(EventType.L1_ALLOCATION_FAILED)[0].metadata.num_bytes == 2 * G.nbytes
    p.finish([e for _, e in res.new])


def test_a_partial_reservation_stops_with_its_slots_instead_of_waiting() -> None:
    """A store that waits while sitting on part of its reservation can wait on every other
    store doing the same; a partial one hands back what it has for writing through first."""
    sink = Sink()
    p = pool(4, sink=sink)
    write(p, [1, 2])
    held = p.acquire([1, 2])  # a retrieve is copying out of them
    t0 = time.monotonic()
    res = p.begin_write(G, [3, 4, 5, 6], wait_s=60, partial=True)
    assert time.monotonic() - t0 < 30  # it did not wait out the bound
    assert [i for i, _ in res.new] == [0, 1] and res.settled == 2 and res.failed == 0
    assert not sink.of(EventType.L1_ALLOCATION_FAILED)  # nothing was given up
    assert p.info()["pinned_chunks"] == 4
    p.finish([e for _, e in res.new])
    p.release(held)
    assert p.info()["pinned_chunks"] == 0


def test_a_writer_with_nothing_in_hand_waits_for_a_pin_to_go() -> None:
    p = pool(2)
    write(p, [1, 2])
    held = p.acquire([1, 2])
    got: list[WriteReservation] = []
    writer = threading.Thread(target=lambda: got.append(p.begin_write(G, [3], wait_s=60, partial=True)))
    writer.start()
    deadline = time.monotonic() + 30
    while p.info()["waiting_writers"] == 0 and time.monotonic() < deadline:
        writer.join(0.001)  # no event to await: the writer is parked on the pool's condition
    assert p.info()["waiting_writers"] == 1
    t0 = time.monotonic()
    p.release(held[:1])  # the release wakes it; the 60 s bound does not
    writer.join(30)
    assert not writer.is_alive() and time.monotonic() - t0 < 30
    (res,) = got
    assert [i for i, _ in res.new] == [0] and res.failed == 0
    assert 1 not in p and 2 in p  # the released chunk made the room


def test_a_load_never_waits_for_the_pins_its_caller_holds_yet_waits_for_anothers() -> None:
    """A retrieve pins its prefix, then loads the rest from L2. Its own pins (on a prefix
    another tenant brought in, under a shared salt, and on its own chunks) stay while it
    waits: the load used to wait its whole bound for them, then end the prefix anyway."""
    p = pool(4)
    for keys, tenant in (([1, 2], "a"), ([3, 4], "v")):
        p.finish([e for _, e in p.begin_write(G, keys, tenant=tenant).new])
    mine = p.acquire([1, 2, 3])  # "v"'s retrieve
    other = p.acquire([4])  # another reader's
    t0 = time.monotonic()
    assert p.begin_load(G, [5], wait_s=3, tenant="v", held=mine + other) == []  # all its own: no wait
    assert time.monotonic() - t0 < 3
    got: list[list[L1Entry]] = []
    loader = threading.Thread(
        target=lambda: got.append(p.begin_load(G, [5], wait_s=60, tenant="v", held=mine))
    )
    loader.start()
    deadline = time.monotonic() + 30
    while p.info()["waiting_loaders"] == 0 and time.monotonic() < deadline:
        loader.join(0.001)  # no event to await: the loader is parked on the pool's condition
    assert p.info()["waiting_loaders"] == 1  # the other reader's pin may give it room
    p.release(other)
    loader.join(30)
    assert not loader.is_alive()
    ((entry,),) = got
    assert entry.key == 5 and 4 not in p and all(k in p for k in (1, 2, 3))
    p.finish([entry])
    p.release(mine)
    assert p.info()["pinned_chunks"] == 0


def test_chunk_larger_than_pool_fails_cleanly() -> None:
    p = L1Pool(G.stride // 2)
    res = p.begin_write(G, [1])
    assert res.failed == 1 and not res.new and p.allocated_bytes == 0


def test_clear_and_evict_and_info() -> None:
    sink = Sink()
    p = pool(4, sink=sink)
    write(p, [1, 2, 3])
    held = p.acquire([1])
    assert p.evict([2, 99]) == 1 and 2 not in p
    assert p.clear() == 1  # 3; 1 is pinned
    assert sink.of(EventType.L1_CLEARED)[-1].metadata == L1Cleared(num_keys=1)
    info = p.info()
    assert info["num_chunks"] == 1 and info["slabs"][0]["shape"] == list(G.shape)
    p.release(held)
    assert p.info()["evictable_chunks"] == 1


def test_releasing_nothing_takes_no_lock_and_publishes_nothing() -> None:
    # A retrieve whose pinned prefix is all READY cuts nothing: under a flood the pool's lock
    # is contended, and taking it for nothing cost an L1 hit milliseconds of waiting.
    sink = Sink()
    p = pool(4, sink=sink)
    write(p, [1])
    events = len(sink.events)
    done = threading.Event()

    def release_nothing() -> None:
        p.release([], read_bytes=0)
        done.set()

    with p._lock:  # another thread holds the pool
        t = threading.Thread(target=release_nothing)
        t.start()
        released = done.wait(5)
    t.join()
    assert released and len(sink.events) == events


def test_pin_memory_requires_cuda() -> None:
    assert L1Pool(1 << 20).pin_memory is torch.cuda.is_available()
    if not torch.cuda.is_available():
        p = L1Pool(1 << 20, pin_memory=True)  # pinning without a driver fails -> a full pool
        assert p.begin_write(G, [1]).failed == 1


def test_write_finished_event() -> None:
    sink = Sink()
    p = pool(4, sink=sink)
    write(p, [7, 8])
    (ev,) = sink.of(EventType.L1_WRITE_FINISHED)
    assert ev.metadata.keys == [7, 8] and ev.metadata.num_bytes == 2 * G.nbytes
    assert ev.metadata.used_bytes == 2 * G.stride


@pytest.mark.parametrize("n", [1, 3])
def test_failed_write_frees_slots(n: int) -> None:
    p = pool(4)
    res = p.begin_write(G, list(range(n)))
    p.finish([e for _, e in res.new], False)
    assert len(p) == 0 and p.used_bytes == 0


def _drained(policy: LRUPolicy) -> list[int]:
    """The policy's keys, oldest first (emptying it)."""
    out = []
    while (key := policy.victim()) is not None:
        out.append(key)
        policy.discard(key)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_walk_answers_and_orders_the_lru_as_walks_one_by_one(seed: int) -> None:
    """``resident_many`` walks a head the lists share once and touches each key once; its
    answers, and the LRU order it leaves, are those of ``resident`` of each list in turn,
    whatever is ready, loading or being written, and whatever ``shared`` says the lists share."""
    rng = random.Random(seed)
    policies = LRUPolicy(), LRUPolicy()
    pools = [L1Pool(64 * G.stride, extent_bytes=2 * G.stride, policy=lambda p=p: p) for p in policies]
    ready = rng.sample(range(1, 40), 24)
    loading, writing = rng.sample([k for k in range(1, 40) if k not in ready], 2)
    for p in pools:
        write(p, ready)
        p.begin_load(G, [loading])
        p.begin_write(G, [writing])
    lists: list[list[int]] = []
    shared = []
    for _ in range(rng.randrange(1, 9)):
        same = rng.randrange(0, len(lists[-1]) + 1) if lists else 0
        head = lists[-1][:same] if lists else []
        tail = [rng.choice(ready) if rng.random() < 0.7 else rng.randrange(1, 40) for _ in range(6)]
        lists.append(head + tail)
        shared.append(same)
    one_by_one = [pools[0].resident(keys) for keys in lists]
    assert pools[1].resident_many(lists, shared) == one_by_one
    assert _drained(policies[1]) == _drained(policies[0])
