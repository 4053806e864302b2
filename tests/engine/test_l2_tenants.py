"""The engine writes to the disk tier on behalf of each chunk's owner in L1: a store's
write-through, a hit's promotion, and the victim an admission policy weighs a candidate
against (the disk tier is shared out between tenants: ``storage.shares``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.engine.admission import admitted_on_store
from kvcache.layouts import KVFormat
from kvcache.observability.event import NullEventBus
from kvcache.storage.admission import TinyLFUAdmission
from kvcache.storage.l1.pool import L1Pool, SlotShape
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.testing import caches_equal, make_kv_caches

BS, CS = 16, 32
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
TOKENS = list(range(500, 500 + 8 * BS))  # 4 chunks
IDS = list(range(8))
FILE = 33_000  # about one chunk file of these caches (32 KiB of KV, its header and meta)


def engine(**kw: Any) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l1_extent_bytes=1 << 16, **kw)
    return CacheEngine(cfg)


def reg(e: CacheEngine, iid: int, seed: int, tenant: str) -> Any:
    caches = make_kv_caches(FMT, num_blocks=8, block_size=BS, seed=seed)
    e.register(iid, "m", caches, tenant=tenant)
    return caches


def test_a_tenant_storing_four_times_the_disk_tier_leaves_anothers_prompt_on_it(tmp_path: Path) -> None:
    """Before, every write-through was the tier's and the flood's 40 chunks evicted the
    victim's 4 from disk (the oldest); a retrieve after L1 lost them found nothing."""
    with engine(l2_disk_path=str(tmp_path), l2_disk_size_bytes=10 * FILE) as e:
        src = reg(e, 1, seed=1, tenant="v")
        reg(e, 2, seed=2, tenant="a")
        e.store(1, TOKENS, IDS)
        for i in range(10):
            e.store(2, [t + 10_000 * (i + 1) for t in TOKENS], IDS)
        assert e.flush(10)
        e._pool.clear()  # L1 lost everything: the victim's prompt can come only from disk
        dst = reg(e, 3, seed=3, tenant="v")
        assert e.retrieve(3, TOKENS, IDS) == len(TOKENS), "the flood evicted the victim's files"
        assert caches_equal(src, dst)
        disk = e.status()["l2"][0]
        assert set(disk["tenant_bytes"]) == {"v", "a"} and disk["used_bytes"] <= 10 * FILE, disk


def test_a_promotion_is_charged_to_the_chunks_owner_not_to_its_reader(tmp_path: Path) -> None:
    with engine(l2_disk_path=str(tmp_path), l2_disk_admission="second-hit") as e:
        reg(e, 1, seed=1, tenant="v")
        e.store(1, TOKENS, IDS)  # a first sighting: not written
        assert e.flush(10) and e.status()["l2"][0]["num_chunks"] == 0
        reg(e, 2, seed=2, tenant="r")
        assert e.retrieve(2, TOKENS, IDS) == len(TOKENS)  # its hit promotes v's chunks
        assert e.flush(10)
        disk = e.status()["l2"][0]
        assert disk["num_chunks"] == 4 and set(disk["tenant_bytes"]) == {"v"}


def test_admission_weighs_the_victim_of_the_writers_own_write(tmp_path: Path) -> None:
    """``v``'s chunk is the tier's oldest and often read; ``a`` holds more, so a write of
    ``v``'s evicts one of ``a``'s, read once. Asked for the tier's oldest (as before),
    TinyLFU declined ``v``'s candidate against its own popular chunk."""
    shape = SlotShape((2, 2, 16, 64), torch.bfloat16)
    kv = torch.zeros(shape.shape, dtype=shape.dtype)
    size = DiskL2Adapter(str(tmp_path / "probe"), 1 << 20).store_with_meta(0, kv, None, b"", "v")
    disk = DiskL2Adapter(str(tmp_path / "tier"), 4 * size)
    for key, tenant in ((1, "v"), (10, "a"), (11, "a"), (12, "a")):  # full
        disk.store_with_meta(key, kv, None, b"", tenant)
    policy = TinyLFUAdmission()
    tier = AsyncL2(disk, admission=policy)
    for key in (1, 1, 1, 1, 10, 11, 12, 50):
        policy.on_store(key, None)  # 1 is popular; the candidate 50 seen once before
    pool = L1Pool(1 << 20, extent_bytes=1 << 18, pin_memory=False)
    (_, entry), *_ = pool.begin_write(shape, [50], tenant="v").new
    assert disk.victim_for(entry.nbytes, "v") == 10 and disk.victim_for(entry.nbytes, "a") == 10
    assert admitted_on_store(tier, [entry], NullEventBus()) == [entry]
    pool.finish([entry])
    tier.close()
