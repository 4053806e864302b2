"""Several threads storing, looking up and retrieving at once: no lost or corrupted chunk."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.context import CacheContext
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches

BS, CS, NB = 16, 32, 64
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
PROMPTS = 8
PROMPT_BLOCKS = 8  # 128 tokens, 4 chunks each; prompt p lives in src blocks [8p, 8p + 8)


def block_crcs(ctx: CacheContext, ids: list[int]) -> list[int]:
    chunks = ctx.allocate_chunks(len(ids), num_tokens=BS)
    for b, c in zip(ids, chunks, strict=True):
        ctx.copy_to_chunks([b], [c])
    return [zlib.crc32(c.view(torch.uint8).numpy().tobytes()) for c in chunks]


@pytest.mark.parametrize("tier", ["l1", "disk"])
def test_concurrent_store_lookup_retrieve(tmp_path: Path, tier: str) -> None:
    kw = {"l2_disk_path": str(tmp_path)} if tier == "disk" else {}
    src_caches = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=1)
    probe = CacheContext(src_caches, chunk_size=CS)
    # room for ~half of the 32 chunks: eviction (and, with disk, L2 prefetch) runs concurrently
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=16 * probe.chunk_nbytes(), l1_extent_bytes=1 << 16, **kw)
    e = CacheEngine(cfg)
    src = e.register(0, "m", src_caches)
    prompts = [[p * 100_000 + i for i in range(PROMPT_BLOCKS * BS)] for p in range(PROMPTS)]
    src_ids = [list(range(p * PROMPT_BLOCKS, (p + 1) * PROMPT_BLOCKS)) for p in range(PROMPTS)]
    want = [block_crcs(src, ids) for ids in src_ids]
    errors: list[BaseException] = []
    checked = [0]
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            dst = e.register(
                w + 1, "m", make_kv_caches(FMT, num_blocks=PROMPT_BLOCKS, block_size=BS, seed=w + 9)
            )
            dst_ids = list(range(PROMPT_BLOCKS))
            for step in range(40):
                p = (w * 7 + step * 3) % PROMPTS
                e.store(0, prompts[p], src_ids[p])
                hit = e.lookup(w + 1, prompts[p])
                got = e.retrieve(w + 1, prompts[p], dst_ids)
                assert got % CS == 0 and 0 <= got <= len(prompts[p]) and hit % CS == 0
                n = got // BS
                assert block_crcs(dst, dst_ids[:n]) == want[p][:n], (w, step, p)
                with lock:
                    checked[0] += n
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert checked[0] > 0
    e.flush(10)
    st = e.status()
    assert st["l1"]["used_bytes"] <= cfg.l1_size_bytes
    assert st["l1"]["evictable_chunks"] == st["l1"]["num_chunks"]  # every pin was released
    if tier == "disk":
        assert st["l2"][0]["load_failures"] == 0 and st["l2"][0]["store_failures"] == 0
    s = e.stats_snapshot()
    assert s.lookups == 160 and s.retrieve.tokens == checked[0] * BS
    e.close()
