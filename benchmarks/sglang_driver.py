"""The SGLang side of ``python -m benchmarks.sglang``: runs in SGLang's venv, never in kvcache's.

``python -m benchmarks.sglang_driver SPEC_JSON`` measures, on SGLang's own CPU host pools,
pages per second set and got through each path, and prints one JSON line (``Figures``):

* ``kvcache in place``: a ``layer_first`` pool in kvcache memfds (``shared_pool.install()``), the
  backend built by SGLang's ``StorageBackendFactory`` (``dynamic``); the daemon copies pages
  straight between the pool and its L1.
* ``kvcache staged``: SGLang's default ``page_first`` pool in its own memory; the backend moves
  each batch through its sealed staging buffer.
* ``file layer_first`` / ``file page_first``: SGLang's file backend (``HiCacheFile``, v2), one
  file per page under ``file_dir``, on the same pools.

Every round (``warmup`` untimed ones first) runs every path once, in turn, with fresh page keys
(``get_hash_str``), so no set is skipped as present and every path sees the machine's load of
that moment. Each path sets
``pages`` pages in SGLang's batches (``batch`` pages a call, as its cache controller sends),
then gets them back into other pages of the pool, and checks the bytes.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from benchmarks.sglang import Spec
from kvcache.integrations.sglang import shared_pool
from kvcache.integrations.sglang.host import canonical_view

PATHS = ("kvcache in place", "kvcache staged", "file layer_first", "file page_first")


class Figures(msgspec.Struct):
    """Per path, pages per second of each round (set, then get)."""

    set_pages_per_s: dict[str, list[float]]
    get_pages_per_s: dict[str, list[float]]
    page_bytes: int


Op = Callable[[list[str], torch.Tensor], Any]


def host_pool(spec: Spec, layout: str) -> Any:
    """SGLang's MHA host pool: room for the pages set and the pages got back."""
    tokens = spec.pages * spec.page_size
    dev = MHATokenToKVPool(tokens, spec.page_size, torch.bfloat16, spec.heads, spec.head_size, spec.layers,
                           "cpu", False)  # fmt: skip
    pool = MHATokenToKVPoolHost(
        dev._mha_buffer_info(), 2.0, 0, spec.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=spec.layers,
    )  # fmt: skip
    flat = pool.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-(1 << 15), 1 << 15, flat.shape, dtype=torch.int16))
    return pool


def _config(spec: Spec, layout: str, extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=layout != "layer_first", model_name="bench",
        extra_config=extra,
    )  # fmt: skip


def kvcache_ops(spec: Spec, pool: Any) -> tuple[Op, Op, Callable[[], None]]:
    extra = {"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang.backend",
             "class_name": "KVCacheStorage", "interface_v1": 1, "endpoint": spec.endpoint,
             "staging_pages": spec.batch, "timeout_s": 60}  # fmt: skip
    b = StorageBackendFactory.create_backend("dynamic", _config(spec, pool.layout, extra), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b.batch_set_v1, b.batch_get_v1, b.close


def file_ops(spec: Spec, pool: Any, path: str) -> tuple[Op, Op, Callable[[], None]]:
    f = HiCacheFile(_config(spec, pool.layout, {"file_storage_path": path}), file_path=path)
    f.register_mem_host_pool_v2(pool, PoolName.KV)

    def put(keys: list[str], idx: torch.Tensor) -> list[bool]:
        return list(f.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])["kv"])

    def get(keys: list[str], idx: torch.Tensor) -> list[bool]:
        return list(f.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])["kv"])

    return put, get, lambda: None


def _timed(spec: Spec, keys: list[str], op: Op, first_page: int) -> float:
    """Pages per second of ``op`` over every page, ``batch`` pages a call; every page must land."""
    ps, n = spec.page_size, spec.pages
    idx = torch.arange(first_page * ps, (first_page + n) * ps, dtype=torch.int64)
    t0 = time.perf_counter()
    for lo in range(0, n, spec.batch):
        done = op(keys[lo : lo + spec.batch], idx[lo * ps : (lo + spec.batch) * ps])
        if not all(done):
            raise RuntimeError(f"{done.count(False)} of {len(done)} pages were not moved")
    return n / (time.perf_counter() - t0)


def run(spec: Spec) -> Figures:
    shared_pool.install()
    try:
        in_place = host_pool(spec, "layer_first")
    finally:
        shared_pool.uninstall()
    pools = {"kvcache in place": in_place, "kvcache staged": host_pool(spec, "page_first"),
             "file layer_first": host_pool(spec, "layer_first"),
             "file page_first": host_pool(spec, "page_first")}  # fmt: skip
    sets: dict[str, list[float]] = {p: [] for p in PATHS}
    gets: dict[str, list[float]] = {p: [] for p in PATHS}
    with tempfile.TemporaryDirectory(dir=spec.file_dir, prefix="hicache-file-") as tmp:
        ops = {p: kvcache_ops(spec, pools[p]) if p.startswith("kvcache") else file_ops(spec, pools[p], tmp)
               for p in PATHS}  # fmt: skip
        for r in range(spec.warmup + spec.rounds):
            for i, path in enumerate(PATHS):
                put, get, _ = ops[path]
                seed = (r * len(PATHS) + i) * spec.pages * spec.page_size
                ids = list(range(seed, seed + spec.pages * spec.page_size))
                keys = get_hash_str(ids, None, page_size=spec.page_size)
                set_rate, get_rate = _timed(spec, keys, put, 0), _timed(spec, keys, get, spec.pages)
                if r >= spec.warmup:
                    sets[path].append(set_rate)
                    gets[path].append(get_rate)
                pool = pools[path]
                view = canonical_view(pool.kv_buffer, pool.layout, mla=False, page_size=spec.page_size)
                n = spec.pages
                if not torch.equal(view[:, :, n : 2 * n].view(torch.int16), view[:, :, :n].view(torch.int16)):
                    raise RuntimeError(f"{path}: the pages got back differ from the pages set")
        for _, _, close in ops.values():
            close()
    page_bytes = 2 * spec.layers * spec.page_size * spec.heads * spec.head_size * 2
    return Figures(sets, gets, page_bytes)


if __name__ == "__main__":
    figures = run(msgspec.json.decode(sys.argv[1], type=Spec))
    print(json.dumps(msgspec.to_builtins(figures)), flush=True)
