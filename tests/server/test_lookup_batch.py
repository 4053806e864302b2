"""``KVCacheClient.lookup_batch`` against a real daemon: one answer per item, in order, the
same as single lookups give, whatever the mix of hits, salts and misses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids, with_heads
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

TOKENS, BLOCKS = list(range(64)), list(range(16))


def _cache() -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=0)  # fmt: skip
    return to_shared(kv)


def test_a_batch_answers_each_item_as_a_single_lookup_would(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache())
        c.store(TOKENS, BLOCKS, cache_salt="x")
        c.store(TOKENS[:32], BLOCKS[:8], key_extra="lora-1")
        asks = [
            (TOKENS, "x", ""),
            (TOKENS, "", ""),  # another salt: a miss
            (TOKENS[:48] + [999] * 16, "x", ""),  # diverges in the fourth chunk
            (TOKENS, "", "lora-1"),  # the adapter's chunks: its first two
            (TOKENS[:15], "x", ""),  # shorter than a chunk
        ]
        items = [
            m.LookupItem(token_ids=pack_ids(t), cache_salt=s, request_id=f"r{i}", key_extra=k)
            for i, (t, s, k) in enumerate(asks)
        ]
        single = [c.lookup_tiers(t, cache_salt=s, key_extra=k) for t, s, k in asks]
        hits = c.lookup_batch(items)
        assert [(h.hit_tokens, h.l2_hit_tokens) for h in hits] == [
            (r.hit_tokens, r.l2_hit_tokens) for r in single
        ]
        assert [h.hit_tokens for h in hits] == [64, 0, 48, 32, 0]
        # 64-bit ids (the daemon hashes 32-bit ones as they came): in range, they name the
        # same chunks; past 2**32, a chunk of them is another chunk.
        wide = [
            m.LookupItem(token_ids=m.IdArray(np.asarray(TOKENS, "<i8").tobytes(), 8), cache_salt="x"),
            m.LookupItem(token_ids=pack_ids(TOKENS[:16] + [2**40] * 16 + TOKENS[32:]), cache_salt="x"),
            items[0],
        ]
        assert [h.hit_tokens for h in c.lookup_batch(wide)] == [64, 16, 64]
        # More items than one message carries: split, and still in order.
        many = items * (m.MAX_LOOKUP_BATCH // len(items) + 2)
        assert [h.hit_tokens for h in c.lookup_batch(many)] == [64, 0, 48, 32, 0] * (len(many) // 5)
        assert c.lookup_batch([]) == []


def test_items_that_send_a_shared_head_once_get_the_answers_of_whole_items(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """``with_heads`` leaves out of each item the whole chunks it shares with the item
    before (a system prompt goes on the wire once); the daemon adds them back, so every
    answer is the one the whole item gets, salts and misses included."""
    d = start_daemon()
    with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache())
        c.store(TOKENS, BLOCKS, cache_salt="x")
        c.store(TOKENS[:48] + [7] * 16, BLOCKS, cache_salt="x")
        asks = [
            (TOKENS, "x"),
            (TOKENS[:48] + [7] * 16, "x"),  # shares three chunks with the one before
            (TOKENS[:48] + [8] * 16, "x"),  # three, then a miss
            (TOKENS[:48] + [7] * 16, ""),  # the same ids in another salt: a miss
            (TOKENS[:20], "x"),  # one chunk, and part of the next
            (TOKENS, "x"),
        ]
        whole = [m.LookupItem(token_ids=pack_ids(t), cache_salt=s) for t, s in asks]
        headed = with_heads(whole, chunk_tokens=16)
        assert [i.head for i in headed] == [0, 48, 48, 48, 16, 16]
        assert sum(len(i.token_ids.data) for i in headed) < sum(len(i.token_ids.data) for i in whole) / 2
        assert [(h.hit_tokens, h.l2_hit_tokens) for h in c.lookup_batch(headed)] == [
            (h.hit_tokens, h.l2_hit_tokens) for h in c.lookup_batch(whole)
        ]
        assert [h.hit_tokens for h in c.lookup_batch(headed)] == [64, 64, 48, 0, 16, 64]
