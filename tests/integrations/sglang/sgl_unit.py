"""Runs inside the SGLang venv (``scripts/sglang_env.sh``), driven by ``test_sglang.py``.

Everything here is SGLang's own: ``StorageBackendFactory`` with a real ``HiCacheStorageConfig``
builds the backend, real CPU host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) in
every layout hold the bytes, a hybrid model's pools are grouped by ``HostPoolGroup`` with a real
``MambaPoolHost``, and ``get_hash_str`` makes the page keys. The daemon is real (its
endpoint is argv[1]). Each check prints one ``ok NAME`` line; any failure exits non-zero.
(Pages per second against SGLang's file backend: ``python -m benchmarks.sglang``.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from kvcache.integrations.sglang import shared_pool
from kvcache.integrations.sglang.backend import KVCacheStorage
from kvcache.integrations.sglang.host import canonical_view

ENDPOINT = sys.argv[1]
PS, NL, NH, HS, DEV_TOKENS = 4, 3, 2, 8, 64
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CHECKS: list[str] = []


def host_pool(layout: str, *, mla: bool = False, dev_tokens: int = DEV_TOKENS, nl: int = NL, nh: int = NH,
              hs: int = HS, ps: int = PS) -> Any:  # fmt: skip
    if mla:
        dev: Any = MLATokenToKVPool(dev_tokens, ps, torch.bfloat16, 16, 8, nl, "cpu", False)
        pool = MLATokenToKVPoolHost(
            dev._mla_buffer_info(), 2.0, 0, ps, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=dev_tokens, start_layer=0, end_layer=nl, target_layer_num=nl,
        )  # fmt: skip
    else:
        dev = MHATokenToKVPool(dev_tokens, ps, torch.bfloat16, nh, hs, nl, "cpu", False)
        pool = MHATokenToKVPoolHost(
            dev._mha_buffer_info(), 2.0, 0, ps, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=dev_tokens, start_layer=0, end_layer=nl,
        )  # fmt: skip
    flat = pool.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-(1 << 15), 1 << 15, flat.shape, dtype=torch.int16))
    return pool


def backend(
    pool: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    side: dict[str, Any] | None = None,
    **extra: Any,
) -> KVCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first",
        model_name="tiny/llama", extra_config={
            "backend_name": "kvcache", "module_path": "kvcache.integrations.sglang.backend",
            "class_name": "KVCacheStorage", "interface_v1": 1, "endpoint": ENDPOINT, **extra,
        },
    )  # fmt: skip
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)
    for name, side_pool in (side or {}).items():  # as HybridCacheController.attach_storage_backend
        b.register_mem_host_pool_v2(side_pool, name)
    b.on_host_pools_registered()
    assert isinstance(b, KVCacheStorage), type(b)
    return b


def indices(pages: list[int], ps: int = PS) -> torch.Tensor:
    return torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=torch.int64)


def page_bytes(pool: Any, pages: list[int], mla: bool = False) -> torch.Tensor:
    view = canonical_view(pool.kv_buffer, pool.layout, mla=mla, page_size=pool.page_size)
    return view[:, :, pages].contiguous().view(torch.int16)


def keys_for(n: int, salt: int = 0, ps: int = PS) -> list[str]:
    keys = get_hash_str([salt * 100_000 + i for i in range(n * ps)], None, page_size=ps)
    assert isinstance(keys, list) and len(keys) == n
    return keys


def check(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            fn()
            CHECKS.append(name)
            print("ok", name, flush=True)

        return run

    return wrap


def round_trip(layout: str, mla: bool, salt: int) -> None:
    pool = host_pool(layout, mla=mla)
    b = backend(pool, mla=mla)
    keys = keys_for(8, salt)
    src, dst = list(range(3, 11)), list(range(20, 28))
    assert b.batch_set_v1(keys, indices(src)) == [True] * 8
    assert b.batch_exists(keys) == 8
    assert b.batch_exists([*keys[:3], "f" * 64, *keys[4:]]) == 3  # the leading run only
    assert b.batch_exists(keys_for(2, salt + 1)) == 0
    assert b.batch_get_v1([*keys[:5], "e" * 64, *keys[6:]], indices(dst)) == [True] * 5 + [False] * 3
    assert torch.equal(page_bytes(pool, dst[:5], mla), page_bytes(pool, src[:5], mla))
    b.close()


@check("mha round trips byte for byte, prefix exists, in all four host layouts (staged)")
def mha_layouts() -> None:
    for i, layout in enumerate(MHA_LAYOUTS):
        round_trip(layout, False, 10 + i)


@check("mla round trips in its three host layouts")
def mla_layouts() -> None:
    for i, layout in enumerate(MLA_LAYOUTS):
        round_trip(layout, True, 20 + i)


@check("layer_first pool in a kvcache memfd is registered in place (zero copy)")
def zero_copy() -> None:
    shared_pool.install()
    try:
        for mla in (False, True):
            pool = host_pool("layer_first", mla=mla)
            b = backend(pool, mla=mla)
            assert b.pages is not None and b.pages.zero_copy
            b.close()
            round_trip("layer_first", mla, 30 + mla)
    finally:
        shared_pool.uninstall()


@check("pages stored from one host layout are the same bytes read into another")
def across_layouts() -> None:
    a_pool, b_pool = host_pool("page_head"), host_pool("layer_first")
    a, b = backend(a_pool), backend(b_pool)
    keys = keys_for(4, 40)
    assert a.batch_set_v1(keys, indices([1, 2, 3, 4])) == [True] * 4
    assert b.batch_get_v1(keys, indices([9, 10, 11, 12])) == [True] * 4
    assert torch.equal(page_bytes(b_pool, [9, 10, 11, 12]), page_bytes(a_pool, [1, 2, 3, 4]))


@check("two tensor-parallel ranks (MHA) keep their own pages")
def tp_ranks() -> None:
    pools = [host_pool("page_first") for _ in range(2)]
    ranks = [backend(p, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    keys = keys_for(4, 50)
    assert ranks[0].batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[1].batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    for pool, rank in zip(pools, ranks, strict=True):
        assert rank.batch_get_v1(keys, indices([5, 6, 7, 8])) == [True] * 4
        assert torch.equal(page_bytes(pool, [5, 6, 7, 8]), page_bytes(pool, [0, 1, 2, 3]))


@check("MLA: only rank 0 writes, rank 1 reads its pages")
def mla_writer() -> None:
    p0, p1 = host_pool("layer_first", mla=True), host_pool("layer_first", mla=True)
    r0, r1 = backend(p0, tp_rank=0, tp_size=2, mla=True), backend(p1, tp_rank=1, tp_size=2, mla=True)
    keys, other = keys_for(3, 60), keys_for(3, 61)
    assert r1.batch_set_v1(other, indices([0, 1, 2])) == [True] * 3  # answered, not written
    assert r0.batch_exists(other) == 0
    assert r0.batch_set_v1(keys, indices([4, 5, 6])) == [True] * 3
    assert r1.batch_get_v1(keys, indices([10, 11, 12])) == [True] * 3
    assert torch.equal(page_bytes(p1, [10, 11, 12], True), page_bytes(p0, [4, 5, 6], True))


@check("two tenants (cache salts) never see each other's pages")
def tenants() -> None:
    pa, pb = host_pool("layer_first"), host_pool("layer_first")
    a, b = backend(pa, cache_salt="tenant-a"), backend(pb, cache_salt="tenant-b")
    keys = keys_for(4, 70)
    assert a.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    before = pb.kv_buffer.clone()
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
    assert torch.equal(pb.kv_buffer.view(torch.int16), before.view(torch.int16))


@check("v2 (PoolTransfer) and legacy (flat pages) entry points")
def v2_and_legacy() -> None:
    pool = host_pool("page_first")
    b = backend(pool)
    keys = keys_for(4, 80)
    put = PoolTransfer(name=PoolName.KV, host_indices=indices([0, 1, 2, 3]), keys=keys)
    assert b.batch_set_v2([put]) == {"kv": [True] * 4}
    assert b.batch_exists_v2(keys).kv_hit_pages == 4
    got = PoolTransfer(name=PoolName.KV, host_indices=indices([8, 9, 10, 11]), keys=keys)
    assert b.batch_get_v2([got]) == {"kv": [True] * 4}
    assert torch.equal(page_bytes(pool, [8, 9, 10, 11]), page_bytes(pool, [0, 1, 2, 3]))
    legacy = keys_for(2, 81)
    assert b.batch_set(legacy, [pool.get_data_page(p * PS, flat=True) for p in (4, 5)])
    assert b.exists(legacy[0])
    targets = [pool.get_dummy_flat_data_page() for _ in legacy]
    assert all(t is not None for t in b.batch_get(legacy, targets))
    for t, p in zip(targets, (4, 5), strict=True):
        assert torch.equal(t.view(torch.int16), pool.get_data_page(p * PS, flat=True).view(torch.int16))


def mamba_pool(slots: int = 8) -> MambaPoolHost:
    """SGLang's Mamba host pool (3 layers: a temporal state of 2 heads x 4 x 4, one conv
    state), every byte random."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(3, slots + 1, 2, 4, 4), conv=(torch.zeros(3, slots + 1, 6, 3),)
    )
    pool = MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        buf.copy_(torch.randn_like(buf))
    return pool


def hybrid(tp_rank: int = 0, tp_size: int = 1) -> tuple[KVCacheStorage, Any, MambaPoolHost]:
    """A hybrid model's host pools as SGLang groups them (the KV anchor and a Mamba pool),
    and the backend registered on them as ``HybridCacheController`` does."""
    kv, mamba = host_pool("page_first"), mamba_pool()
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda layer: layer, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, mamba, None, lambda layer: layer),
    ])  # fmt: skip
    b = backend(group, tp_rank=tp_rank, tp_size=tp_size, side={PoolName.KV: kv, PoolName.MAMBA: mamba})
    return b, kv, mamba


def state() -> PoolTransfer:
    """The Mamba transfer SGLang's exists query carries (one trailing page)."""
    return PoolTransfer(
        name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def mamba_at(key: str, slot: int) -> PoolTransfer:
    return PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)  # fmt: skip


@check("hybrid (KV + Mamba pools): each pool's pages keyed apart, a hit only where every pool restores it")
def hybrid_pools() -> None:
    b, kv, mamba = hybrid()
    keys = keys_for(6, 90)
    kv_put = PoolTransfer(name=PoolName.KV, host_indices=indices(list(range(6))), keys=keys)
    assert b.batch_set_v2([kv_put]) == {"kv": [True] * 6}
    assert b.batch_exists_v2(keys, [state()]).kv_hit_pages == 0  # KV alone: no state to resume from
    for page, slot in ((2, 1), (5, 4)):  # one state per node end, as SGLang backs them up
        assert b.batch_set_v2([mamba_at(keys[page], slot)]) == {"mamba": [True]}
    hit = b.batch_exists_v2(keys, [state()])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [3, 6]), hit
    assert hit.extra_pool_hit_pages == {"kv": 6, "mamba": 6}, hit
    assert b.batch_exists_v2(keys[:5], [state()]).restorable_prefix_pages == [3]
    assert b.batch_exists_v2(keys[:2], [state()]).kv_hit_pages == 0
    assert b.batch_exists_v2(keys).kv_hit_pages == 6  # a KV-only query is the KV prefix
    other = keys_for(3, 91)  # a state stored without its KV pages: no hit either
    assert b.batch_set_v2([mamba_at(other[2], 5)]) == {"mamba": [True]}
    assert b.batch_exists_v2(other, [state()]).kv_hit_pages == 0
    assert b.batch_exists(other) == 0  # and it is not a KV page
    kv_get = PoolTransfer(name=PoolName.KV, host_indices=indices(list(range(20, 26))), keys=keys)
    got = b.batch_get_v2([kv_get, mamba_at(keys[5], 7)])
    assert got == {"kv": [True] * 6, "mamba": [True]}, got
    assert torch.equal(page_bytes(kv, list(range(20, 26))), page_bytes(kv, list(range(6))))
    assert torch.equal(mamba.get_data_page(7), mamba.get_data_page(4)), (
        "the Mamba state differs after a round trip"
    )
    assert not torch.equal(mamba.get_data_page(7), mamba.get_data_page(1))
    before = mamba.get_data_page(6).clone()
    assert b.batch_get_v2([mamba_at(keys_for(1, 92)[0], 6)]) == {"mamba": [False]}
    assert torch.equal(mamba.get_data_page(6), before)  # a miss writes nothing
    rank1, _, _ = hybrid(tp_rank=1, tp_size=2)  # another rank's heads: its own scope
    assert rank1.batch_exists_v2(keys, [state()]).kv_hit_pages == 0
    for x in (b, rank1):
        x.close()


@check("hybrid: a pool kvcache does not hold, or a policy it does not serve, is no hit")
def hybrid_unknown_pool() -> None:
    b, _, _ = hybrid()
    keys = keys_for(4, 95)
    b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0, 1, 2, 3]), keys=keys)])
    b.batch_set_v2([mamba_at(keys[3], 2)])
    swa = PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_exists_v2(keys, [state(), swa]).kv_hit_pages == 0
    groups = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert b.batch_exists_v2(keys, [groups]).kv_hit_pages == 0
    assert b.batch_set_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0]), keys=keys[:1])]
    ) == {"swa": [False]}
    b.close()


if __name__ == "__main__":
    for fn in (
        mha_layouts,
        mla_layouts,
        zero_copy,
        across_layouts,
        tp_ranks,
        mla_writer,
        tenants,
        v2_and_legacy,
        hybrid_pools,
        hybrid_unknown_pool,
    ):
        fn()
    print(f"passed {len(CHECKS)} checks", flush=True)
