"""A lookup's hit is what a retrieve right after it can deliver: its prefetch never evicts a
chunk of the prefix it counts, and its count stops where the prompt no longer fits the
tenant's room in L1.

Observed in-process (L1 of 12 chunks, two tenants, a disk tier): the victim's 8-chunk prompt
had its head on disk and its tail in L1, its tenant at its share. The lookup's loads of the
head evicted the tenant's least recently used chunks, the prompt's own tail (not walked yet),
which it then loaded again, evicting more of the prompt: it answered 8 chunks (7 of them from
disk) although the share holds 7, and the retrieve right after returned 7. The serving engine
planned for 8 and a disk read was wasted on each chunk loaded twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcache.engine import CacheEngine
from kvcache.engine.pages import PAGE_KEY_BYTES, page_keys
from kvcache.engine.retrieve import prefetch
from kvcache.keys import KeyScope
from kvcache.records import ChunkKey
from kvcache.testing import make_kv_caches
from tests.engine.test_retrieve_room import BS, CS, FMT, SLOT, blocks_equal, engine, prompt, reg, retrieved

WAIT_S = 10.0  # bound on waiting for a load the lookup began (an event, never a sleep)


def half_on_disk(e: CacheEngine, *disk_only: list[int]) -> tuple[Any, list[int], list[ChunkKey]]:
    """The colleague's setup: tenant "v"'s 8-chunk prompt with its head (4 chunks) on disk
    only and its tail in L1; "a" holds the other 8 chunks of a 12-chunk L1. ``disk_only``:
    more prompts of "v", stored first and on disk only."""
    src = reg(e, 1, 8, seed=1, tenant="v")
    reg(e, 2, 8, seed=2, tenant="a")
    for other in disk_only:
        assert e.store(1, other, list(range(len(other) // BS))).stored_chunks == len(other) // CS
        assert e.flush(10)
        assert e._pool.clear() == len(other) // CS
    victim = prompt(8, 500)
    assert e.store(1, victim, list(range(16))).stored_chunks == 8
    assert e.flush(10)
    keys = e._instance(1).keys(victim, KeyScope(""))
    assert e._pool.evict(keys[:4]) == 4
    assert e.store(2, prompt(8, 10_000), list(range(16))).stored_chunks == 8
    assert e.flush(10)
    assert e.status()["l1"]["tenant_bytes"] == {"v": 4 * SLOT, "a": 8 * SLOT}
    return src, victim, keys


def settled_in_l1(e: CacheEngine, keys: list[ChunkKey]) -> list[bool]:
    """Whether each key is in L1, once the loads the lookup began have settled."""
    out = []
    for key in keys:
        entry = e._pool.get(key)
        out.append(entry is not None and entry.wait(WAIT_S))
    return out


def test_a_lookups_count_is_what_the_retrieve_after_it_returns_and_it_evicts_none_of_it(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, l1_chunks=12) as e:
        src, victim, keys = half_on_disk(e)
        dst = reg(e, 3, 8, seed=3, tenant="v")
        hit = e.lookup_tiers(3, victim)
        # Its share holds 7 (6 of 12, one more taken from "a" while they are equal); only the
        # head came from disk, each chunk once, and none of the counted prefix was evicted.
        assert hit.hit_tokens == 7 * CS and hit.l2_hit_tokens == 4 * CS
        assert settled_in_l1(e, keys[:7]) == [True] * 7
        assert e.status()["l1"]["tenant_bytes"] == {"v": 7 * SLOT, "a": 5 * SLOT}
        assert e.status()["l1"]["pinned_chunks"] == 0
        n, _ = retrieved(e, 3, victim)
        assert n == hit.hit_tokens
        assert blocks_equal(src, dst, slice(0, 7 * CS // BS))


def test_a_batch_of_lookups_keeps_each_counted_prefix_and_fits_them_all_in_the_share(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, l1_chunks=12) as e:
        other = prompt(3, 90_000)  # a second prompt of "v", on disk only
        _, victim, keys = half_on_disk(e, other)
        reg(e, 3, 8, seed=3, tenant="v")
        queries = [(victim, KeyScope(""), "r1"), (other, KeyScope(""), "r2")]
        first, second = e.lookup_many(3, queries)
        assert first.hit_tokens == 7 * CS and first.l2_hit_tokens == 4 * CS
        # The second prompt's loads never evicted the first one's counted chunks: no room
        # was left for it in the share.
        assert second.hit_tokens == 0
        assert settled_in_l1(e, keys[:7]) == [True] * 7
        assert e.status()["l1"]["pinned_chunks"] == 0
        assert retrieved(e, 3, victim)[0] == first.hit_tokens


def test_a_lookup_alone_still_evicts_its_prompts_tail_for_its_head(tmp_path: Path) -> None:
    """One tenant, a prompt longer than L1, all of it on disk and its tail in L1: the head
    loads, the tail past what fits gives its room (its end first), as before."""
    with engine(tmp_path, l1_chunks=6) as e:
        reg(e, 1, 8, seed=1, tenant="v")
        long = prompt(8, 500)
        assert e.store(1, long, list(range(16))).stored_chunks == 8
        assert e.flush(10)
        keys = e._instance(1).keys(long, KeyScope(""))
        e._pool.clear()
        assert prefetch(e._parts, e._instance(1), keys[2:]) == 6  # its tail back from disk
        assert settled_in_l1(e, keys) == [False, False, True, True, True, True, True, True]
        reg(e, 2, 8, seed=2, tenant="v")
        hit = e.lookup_tiers(2, long)
        assert hit.hit_tokens == 6 * CS and hit.l2_hit_tokens == 2 * CS
        assert settled_in_l1(e, keys) == [True] * 6 + [False] * 2
        assert retrieved(e, 2, long)[0] == hit.hit_tokens


def test_a_pages_exists_counts_only_what_fits_the_share(tmp_path: Path) -> None:
    """The SGLang path (one page per chunk, keyed by the engine) walks as a lookup does."""
    with engine(tmp_path, l1_chunks=6) as e:  # 12 page slots
        e.register(
            1, "m", make_kv_caches(FMT, num_blocks=16, block_size=BS, seed=1), tenant="v", chunk_size=BS
        )
        e.register(
            2, "m", make_kv_caches(FMT, num_blocks=16, block_size=BS, seed=2), tenant="a", chunk_size=BS
        )
        raw = b"".join(bytes([i]) * PAGE_KEY_BYTES for i in range(8))
        assert e.pages.store_async(1, raw, list(range(8))).result(10).stored_chunks == 8
        assert e.flush(10)
        keys = page_keys(e._instance(1), raw, "")
        assert e._pool.evict(keys[:4]) == 4
        fill = b"".join(bytes([100 + i]) * PAGE_KEY_BYTES for i in range(8))
        assert e.pages.store_async(2, fill, list(range(8))).result(10).stored_chunks == 8
        assert e.flush(10)
        page_slot = SLOT * BS // CS
        assert e.status()["l1"]["tenant_bytes"] == {"v": 4 * page_slot, "a": 8 * page_slot}
        assert e.pages.exists(1, raw) == (7, 4)
        assert settled_in_l1(e, keys[:7]) == [True] * 7
        assert e.pages.retrieve_async(1, raw, list(range(8, 16))).result(10).retrieved_tokens == 7 * BS
