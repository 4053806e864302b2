"""Runs inside the SGLang venv (``scripts/sglang_env.sh``), driven by ``test_sglang.py``.

Everything here is SGLang's own: ``StorageBackendFactory`` with a real ``HiCacheStorageConfig``
builds the backend, real CPU host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) in
every layout hold the bytes, and ``get_hash_str`` makes the page keys. The daemon is real (its
endpoint is argv[1]). Each check prints one ``ok NAME`` line; any failure exits non-zero.
(Pages per second against SGLang's file backend: ``python -m benchmarks.sglang``.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
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
    pool: Any, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **extra: Any
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
    ):
        fn()
    print(f"passed {len(CHECKS)} checks", flush=True)
