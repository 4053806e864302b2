"""A retrieve loading its prefix from L2 into L1 never waits for room that only its own pins
could free: it returns the longest prefix that fits (``retrieved_tokens`` less than asked).

Observed against a daemon (L1 of 12 chunks, two principals, a disk tier): the victim's
8-chunk prompt had its head on disk and its tail in L1. Its retrieve pinned the tail and the
head it loaded; the one chunk left needed a slot that, within its share, only its own chunks
could give, and all of them were pinned by that very retrieve. ``L1Pool.begin_load`` counted
those pins as room that might come and waited the whole wait bound (30 s), after which the
client's deadline had passed too: DEADLINE_EXCEEDED instead of 7 chunks of 8. One tenant
whose prompt is longer than L1 waited for itself the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine
from kvcache.keys import KeyScope
from kvcache.layouts import KVFormat
from kvcache.testing import clone_caches, make_kv_caches

BS, CS = 16, 32
BPC = CS // BS
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
SLOT = 2 * 2 * CS * 2 * 64 * 2  # one chunk of make_kv_caches' defaults (2 layers, K and V, bf16)
WAIT_S = 2.0  # the client's deadline: the old wait ran into it


def engine(tmp_path: Path, l1_chunks: int) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=l1_chunks * SLOT, l1_extent_bytes=3 * SLOT,
                       l1_evict_watermark=1.0, l2_disk_path=str(tmp_path))  # fmt: skip
    return CacheEngine(cfg)


def reg(e: CacheEngine, iid: int, chunks: int, seed: int, tenant: str) -> Any:
    caches = make_kv_caches(FMT, num_blocks=chunks * BPC, block_size=BS, seed=seed)
    e.register(iid, "m", caches, tenant=tenant)
    return caches


def prompt(chunks: int, base: int) -> list[int]:
    return list(range(base, base + chunks * CS))


def retrieved(e: CacheEngine, iid: int, tokens: list[int]) -> tuple[int, float]:
    """The retrieve's answer (within the client's deadline ``WAIT_S``) and its seconds."""
    started = time.monotonic()
    ids = list(range(len(tokens) // BS))
    n = e.retrieve(iid, tokens, ids, deadline=Deadline.within(WAIT_S))
    return n, time.monotonic() - started


def blocks_equal(a: Any, b: Any, blocks: slice) -> bool:
    return all(
        torch.equal(x[blocks].view(torch.uint8), y[blocks].view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def test_a_retrieve_over_its_share_returns_the_prefix_that_fits_without_waiting_for_itself(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, l1_chunks=12) as e:
        src = reg(e, 1, 8, seed=1, tenant="v")
        reg(e, 2, 8, seed=2, tenant="a")
        victim = prompt(8, 500)
        assert e.store(1, victim, list(range(16))).stored_chunks == 8
        assert e.flush(10)
        keys = e._instance(1).keys(victim, KeyScope(""))
        assert e._pool.evict(keys[:4]) == 4  # its head left for disk; its tail stays in L1
        assert e.store(2, prompt(8, 10_000), list(range(16))).stored_chunks == 8  # L1 is full
        assert e.flush(10)
        assert e.status()["l1"]["tenant_bytes"] == {"v": 4 * SLOT, "a": 8 * SLOT}
        dst = reg(e, 3, 8, seed=3, tenant="v")
        before = clone_caches(dst)
        # Its share is 6 of 12; one more it takes from "a" while they are equal. The 8th
        # chunk could come only from its own chunks, every one pinned by this retrieve.
        n, seconds = retrieved(e, 3, victim)
        assert n == 7 * CS and seconds < WAIT_S
        assert blocks_equal(src, dst, slice(0, 7 * BPC)) and blocks_equal(before, dst, slice(7 * BPC, None))
        assert e.status()["l1"]["tenant_bytes"] == {"v": 7 * SLOT, "a": 5 * SLOT}
        assert e.status()["l1"]["pinned_chunks"] == 0


def test_one_tenants_retrieve_of_a_prompt_longer_than_l1_returns_what_fits_at_once(tmp_path: Path) -> None:
    with engine(tmp_path, l1_chunks=6) as e:
        src = reg(e, 1, 8, seed=1, tenant="v")
        long = prompt(8, 500)
        assert e.store(1, long, list(range(16))).stored_chunks == 8  # written through, a part at a time
        assert e.flush(10)
        e._pool.clear()  # L1 lost it: it comes from disk alone
        dst = reg(e, 2, 8, seed=2, tenant="v")
        n, seconds = retrieved(e, 2, long)
        assert n == 6 * CS and seconds < WAIT_S
        assert blocks_equal(src, dst, slice(0, 6 * BPC))
