"""Stores under memory pressure: a small L1 in front of a healthy Redis loses no prompt.

Observed before: storing faster than the write-through drains left every L1 slot pinned by
in-flight L2 writes; allocation failed, the store returned as if done, and 5 of 12 prompts
existed in neither tier. Then, with waiting in place, concurrent stores that each held part
of their reservation waited on one another until the bound ran out. Now a store waits
(bounded) only while it holds no fresh slot of its own, writing through what it already has.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine, StoreResult
from kvcache.layouts import KVFormat
from kvcache.observability.event import EventType
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.testing.redis_local import LocalRedis
from tests.helpers import RecordingSink

BS, CS, CHUNKS, PROMPTS = 16, 32, 4, 12
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
BLOCKS = list(range(CHUNKS * CS // BS))


def _kv() -> list[torch.Tensor]:
    return make_kv_caches(FMT, num_layers=2, num_blocks=len(BLOCKS), block_size=BS,
                          num_heads=2, head_size=64, dtype=torch.float16, seed=3)  # fmt: skip


def _slot_bytes(kv: Any) -> int:
    with CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 24)) as probe:
        probe.register(0, "m", kv)
        return int(probe.status()["instances"][0]["chunk_bytes"])


def _prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(CHUNKS * CS)]


def _config(kv: Any, redis: LocalRedis, slots: int, **kw: Any) -> EngineConfig:
    """An L1 of ``slots`` chunk slots (one per extent) in front of ``redis``, one L2 writer."""
    stride = _slot_bytes(kv)
    return EngineConfig(chunk_size=CS, l1_size_bytes=slots * stride, l1_extent_bytes=stride,
                        l2_redis_url=redis.url, l2_workers=1, **kw)  # fmt: skip


def _all_found_whole_and_exact(e: CacheEngine, kv: list[torch.Tensor], prompts: range) -> None:
    want = clone_caches(kv)
    for i in prompts:
        # flush: a lookup's prefetch stops early while the tier's load queue is full (an
        # honest, smaller answer); the previous lookup's loads must have landed.
        assert e.flush(30)
        assert e.lookup(1, _prompt(i)) == CHUNKS * CS, f"prompt {i} is not whole"
    for i in prompts:
        for t in kv:
            t.zero_()
        assert e.retrieve(1, _prompt(i), BLOCKS) == CHUNKS * CS, f"prompt {i}"
        assert caches_equal(kv, want), f"prompt {i} came back with other bytes"
        for t, w in zip(kv, want, strict=True):
            t.copy_(w)


def test_twelve_prompts_through_an_l1_of_three_are_all_found_whole(redis_server: LocalRedis) -> None:
    kv = _kv()
    cfg = _config(kv, redis_server, 3 * CHUNKS, l2_max_inflight=CHUNKS, store_wait_timeout_s=30.0)
    with CacheEngine(cfg) as e:
        e.register(1, "m", kv)
        results = [e.store(1, _prompt(i), BLOCKS) for i in range(PROMPTS)]
        assert all(r.failed_chunks == 0 for r in results), results
        assert sum(r.stored_chunks for r in results) == PROMPTS * CHUNKS
        assert e.flush(30)
        _all_found_whole_and_exact(e, kv, range(PROMPTS))


def test_concurrent_stores_never_wait_on_each_others_reservations(redis_server: LocalRedis) -> None:
    """Four writers, an L1 of one and a half prompts: no store may sit on a part of its
    reservation while waiting for the rest, or they all wait out the bound together."""
    kv = _kv()
    cfg = _config(kv, redis_server, CHUNKS + CHUNKS // 2, l2_max_inflight=CHUNKS, store_wait_timeout_s=10.0)
    results: list[StoreResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    with CacheEngine(cfg) as e:
        e.register(1, "m", kv)

        def writer(w: int) -> None:
            try:
                for i in range(w, PROMPTS, 4):
                    r = e.store(1, _prompt(i), BLOCKS)
                    with lock:
                        results.append(r)
            except BaseException as exc:  # surfaced below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(r.failed_chunks == 0 for r in results), results
        assert sum(r.stored_chunks + r.skipped_chunks for r in results) == PROMPTS * CHUNKS
        assert e.flush(30)
        _all_found_whole_and_exact(e, kv, range(PROMPTS))


def test_without_waiting_drops_are_reported_not_hidden(redis_server: LocalRedis) -> None:
    """The negative control: with no wait allowed the same load drops chunks, and every
    prompt that is not found whole lost a chunk that was reported (``failed_chunks`` in the
    store's result and end event, or an ``L2_STORE_FAILED``)."""
    kv = _kv()
    sink = RecordingSink()
    cfg = _config(kv, redis_server, 3 * CHUNKS, l2_max_inflight=1, store_wait_timeout_s=0.0)
    with CacheEngine(cfg, bus=sink) as e:
        e.register(1, "m", kv)
        results = [e.store(1, _prompt(i), BLOCKS) for i in range(PROMPTS)]
        assert e.flush(30)
        failed = sum(r.failed_chunks for r in results)
        ends = sink.of(EventType.MP_STORE_END)
        assert sum(ev.metadata.failed_chunks for ev in ends) == failed  # counted as reported
        l2 = e.status()["l2"][0]
        dropped = l2["stores_dropped"] + l2["store_failures"]
        assert len(sink.of(EventType.L2_STORE_FAILED)) == dropped  # each L2 drop is an event
        assert failed + dropped > 0  # the pressure is real: without waiting, something gives
        # Every prompt that is not whole lost a chunk of its own, and that chunk was reported.
        # (retrieve, not lookup: its loads wait for the one-deep queue; a lookup's do not)
        whole = sum(e.retrieve(1, _prompt(i), BLOCKS) == CHUNKS * CS for i in range(PROMPTS))
        assert PROMPTS - whole <= failed + dropped
