"""Test-only shims that let SGLang 0.5.23 import and serve on a CPU-only torch (no sgl_kernel, no GPU).

On ``PYTHONPATH`` for the SGLang tiers only; they patch private internals of the pinned version.

1. torchvision: PyPI wheels are CUDA-linked, so an import-only stub (``tv_stub``).
2. ``vllm._custom_ops.rotary_embedding``: pure-torch RoPE (SGLang's non-CUDA fallback imports it).
3. ``KVCACHE_SGLANG_CPU_SHIM=1``: HiCache host pools unpinned, and a torch ``transfer_kv_direct``
   (not ``SGL_*``: SGLang claims that prefix for its own settings and warns about unknown ones).

Not a shim: ``KVCACHE_SGLANG_SHARED_POOL=1`` runs ``shared_pool.install()`` in every process, as
docs/sglang.md tells an operator to (host pools in kvcache memfds, registered in place).
"""

import importlib.util
import os

if importlib.util.find_spec("torchvision") is None:
    import tv_stub  # noqa: F401

if os.environ.get("KVCACHE_SGLANG_CPU_SHIM") == "1":
    import sglang.srt.mem_cache.pool_host.base as _b
    import sglang.srt.mem_cache.pool_host.common as _c
    import sglang.srt.mem_cache.pool_host.mha as _m
    import torch

    _c._cuda_host_register = lambda buffer, *a, **k: None
    _orig_init = _b.HostKVCache.__init__

    def _init(self, *a, **k):  # type: ignore[no-untyped-def]
        k["pin_memory"] = False
        return _orig_init(self, *a, **k)

    _b.HostKVCache.__init__ = _init

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):  # type: ignore[no-untyped-def]
        si = src_indices.to(torch.int64).cpu()
        di = dst_indices.to(torch.int64).cpu()
        for s, d in zip(src_layers, dst_layers, strict=True):
            d[di] = s[si].to(d.dtype)

    _m.transfer_kv_direct = transfer_kv_direct

if os.environ.get("KVCACHE_SGLANG_SHARED_POOL") == "1":
    from kvcache.integrations.sglang import shared_pool

    shared_pool.install()
