"""No silent loss: a small L1 in front of a healthy Redis never drops whole prompts.

Observed before: storing faster than the write-through drains left every L1 slot pinned by
in-flight L2 writes (and the L2 queue full); allocation failed, the store returned as if done,
and 5 of 12 prompts existed in neither tier. Now a store waits (bounded) for room instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import GPUKVFormat
from kvcache.storage.redis_local import LocalRedis
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

BS, CS, CHUNKS, PROMPTS = 16, 32, 4, 12
FMT = GPUKVFormat.NL_X_TWO_NB_BS_NH_HS


@pytest.fixture
def redis_server() -> Any:
    with LocalRedis() as server:
        yield server


def _chunk_bytes(kv: Any) -> int:
    with CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 24)) as probe:
        probe.register(0, "m", kv)
        return int(probe.status()["instances"][0]["chunk_bytes"])


def _prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(CHUNKS * CS)]


def test_twelve_prompts_through_an_l1_of_three_are_all_found_whole(redis_server: LocalRedis) -> None:
    kv = make_kv_caches(FMT, num_layers=2, num_blocks=CHUNKS * CS // BS, block_size=BS,
                        num_heads=2, head_size=64, dtype=torch.float16, seed=3)  # fmt: skip
    blocks = list(range(CHUNKS * CS // BS))
    chunk_stride = _chunk_bytes(kv)
    l1 = 3 * CHUNKS * chunk_stride  # room for 3 prompts of 4 chunks
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=l1, l1_extent_bytes=chunk_stride,
                       l2_redis_url=redis_server.url, l2_max_inflight=CHUNKS, l2_workers=1,
                       store_wait_timeout_s=30.0)  # fmt: skip
    want = clone_caches(kv)
    with CacheEngine(cfg) as e:
        e.register(1, "m", kv)
        results = [e.store(1, _prompt(i), blocks) for i in range(PROMPTS)]
        assert all(r.failed_chunks == 0 for r in results), results
        assert sum(r.stored_chunks for r in results) == PROMPTS * CHUNKS
        assert e.flush(30)
        for i in range(PROMPTS):
            # flush: a lookup's prefetch stops early while the tier's load queue is full
            # (an honest, smaller answer); the previous lookup's loads must have landed.
            assert e.flush(30)
            assert e.lookup(1, _prompt(i)) == CHUNKS * CS, f"prompt {i} is not whole"
        for i in range(PROMPTS):
            for t in kv:
                t.zero_()
            assert e.retrieve(1, _prompt(i), blocks) == CHUNKS * CS, f"prompt {i}"
            assert caches_equal(kv, want), f"prompt {i} came back with other bytes"


def test_without_waiting_the_same_load_drops_chunks_and_says_so(redis_server: LocalRedis) -> None:
    """The negative control: with no wait allowed, drops happen and are reported, not hidden."""
    kv = make_kv_caches(FMT, num_layers=2, num_blocks=CHUNKS * CS // BS, block_size=BS,
                        num_heads=2, head_size=64, dtype=torch.float16, seed=3)  # fmt: skip
    blocks = list(range(CHUNKS * CS // BS))
    chunk_stride = _chunk_bytes(kv)
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=3 * CHUNKS * chunk_stride,
                       l1_extent_bytes=chunk_stride, l2_redis_url=redis_server.url,
                       l2_max_inflight=1, l2_workers=1, store_wait_timeout_s=0.0)  # fmt: skip
    with CacheEngine(cfg) as e:
        e.register(1, "m", kv)
        results = [e.store(1, _prompt(i), blocks) for i in range(PROMPTS)]
        assert e.flush(30)
        l2 = e.status()["l2"][0]
        dropped = sum(r.failed_chunks for r in results) + l2["stores_dropped"]
        found = 0
        for i in range(PROMPTS):
            assert e.flush(30)
            found += e.lookup(1, _prompt(i)) // CS
        assert found + dropped >= PROMPTS * CHUNKS  # every chunk is found or was reported
