"""No silent loss, against a real daemon: a small L1 in front of a healthy Redis drops nothing.

Observed before: storing faster than the write-through drains left every L1 slot pinned by
in-flight L2 writes; allocation failed, the store answered as if done, and whole prompts
existed in neither tier. Here one engine fires all its stores at once (the daemon serves them
on several worker threads), so the stores also compete with each other for L1.
The engine-level twins, with the reasons spelled out, are in tests/engine/test_store_pressure.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import GiB
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.testing.redis_local import LocalRedis

BS, CS, CHUNKS, PROMPTS = 4, 16, 4, 12  # chunk size 16 is the suite's (conftest BASE_ARGS)
BLOCKS = list(range(CHUNKS * CS // BS))
LAYERS, HEADS, HEAD = 8, 8, 128  # chunks of 512 KiB: Redis writes that take a while
CHUNK_BYTES = LAYERS * 2 * CS * HEADS * HEAD * 2  # layers x (K, V) x tokens x heads x head x fp16


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _cache() -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=LAYERS, num_blocks=len(BLOCKS),
                        block_size=BS, num_heads=HEADS, head_size=HEAD, dtype=torch.float16,
                        seed=5)  # fmt: skip
    assert isinstance(kv, list)
    return kv


def _prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(CHUNKS * CS)]


def _writes_drained(c: KVCacheClient, timeout_s: float = 30) -> bool:
    """Whether the daemon's write-through queue emptied (no flush over the wire: ask status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(t["inflight"]["store"] == 0 for t in c.status()["engine"]["l2"]):
            return True
    return False


def _tier_counts(c: KVCacheClient) -> dict[str, int]:
    """The Redis tier's counters, for the failure message: a store that failed is counted, so
    a prompt missing with ``store_failures`` at 0 is the silent loss this file is about."""
    (tier,) = c.status()["engine"]["l2"]
    return {k: v for k, v in tier.items() if isinstance(v, int) and not isinstance(v, bool)}


def _found_whole(c: KVCacheClient, prompt: list[int]) -> bool:
    """Whether a lookup finds the whole prompt. A lookup's read of Redis that failed (a socket
    timeout on a loaded machine, counted as ``contains_failures``/``load_failures``) ends the
    prefix there, a smaller hit and never a wrong one: such a lookup is asked again, up to 3
    times; a chunk missing from both tiers misses every time."""
    for _ in range(3):
        before = _tier_counts(c)
        if c.lookup(prompt) == CHUNKS * CS:
            return True
        after = _tier_counts(c)
        if all(after[k] == before[k] for k in ("contains_failures", "load_failures")):
            return False
    return False


def test_twelve_prompts_stored_at_once_through_an_l1_of_three_are_all_found_whole(
    start_daemon: Callable[..., DaemonProcess], redis_server: LocalRedis
) -> None:
    l1_gb = 3 * CHUNKS * CHUNK_BYTES / GiB  # room for about 3 prompts of 4 chunks
    d = start_daemon("--l1-size-gb", repr(l1_gb), "--l2-redis-url", redis_server.url, "--l2-redis-trust-all",
                     "--store-wait-timeout", "30", "--workers", "4")  # fmt: skip
    kv = to_shared(_cache())
    want = clone_caches(kv)
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=60) as c:
        c.register_kv_caches(kv)
        assert c.status()["engine"]["instances"][0]["chunk_bytes"] == CHUNK_BYTES
        pending = [c.store_async(_prompt(i), BLOCKS) for i in range(PROMPTS)]
        results = [f.result(60) for f in pending]
        assert all(r.failed_chunks == 0 for r in results), results
        assert sum(r.stored_chunks + r.skipped_chunks for r in results) == PROMPTS * CHUNKS
        assert _writes_drained(c)
        for i in range(PROMPTS):
            assert _found_whole(c, _prompt(i)), f"prompt {i} is not whole: {_tier_counts(c)}"
        for i in range(PROMPTS):
            for t in kv:
                t.zero_()
            assert c.retrieve(_prompt(i), BLOCKS) == CHUNKS * CS, f"prompt {i}"
            assert caches_equal(kv, want), f"prompt {i} came back with other bytes"
