"""Fake engine caches in any layout, for tests and benchmarks (ours and integrators').

Filling with random *bytes* (not random floats) makes every bit pattern, including NaN
and fp8 patterns, part of the comparison: the copies must be byte-exact.

Beside it, ``redis_local`` and ``redis_cluster_local`` start real Redis servers and clusters for
tests and benches. Product code never imports them (``tests/testing`` checks it), and this module
does not either, so importing fake caches spawns nothing.
"""

from __future__ import annotations

import torch

from kvcache.layouts import KVCaches, KVFormat

ALL_FORMATS = tuple(KVFormat)
ENGINE_OF = {
    KVFormat.NB_NL_TWO_BS_NH_HS: "vllm",
    KVFormat.NL_X_TWO_NB_BS_NH_HS: "vllm",
    KVFormat.NL_X_NB_TWO_BS_NH_HS: "vllm",
    KVFormat.NL_X_NB_BS_HS: "vllm",
    KVFormat.TWO_X_NL_X_NBBS_NH_HS: "sglang",
    KVFormat.NL_X_NBBS_ONE_HS: "sglang",
    KVFormat.NL_X_NB_PAGE: "vllm",
}


def random_fill(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with random bytes in place (works for every dtype, fp8 included)."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return t


def make_kv_caches(
    fmt: KVFormat,
    num_layers: int = 2,
    num_blocks: int = 8,
    block_size: int = 16,
    num_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    fill: bool = True,
    seed: int = 0,
) -> KVCaches:
    """An engine KV cache of ``fmt`` (MLA formats use ``head_size`` as the latent width
    and ignore ``num_heads``; opaque pages take vLLM's CPU shape)."""
    gen = torch.Generator().manual_seed(seed)
    nl, nb, bs, nh, hs = num_layers, num_blocks, block_size, num_heads, head_size

    def new(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if fill:
            random_fill(t, gen)
        return t.to(device)

    if fmt is KVFormat.NB_NL_TWO_BS_NH_HS:
        return new(nb, nl, 2, bs, nh, hs)
    if fmt is KVFormat.NL_X_TWO_NB_BS_NH_HS:
        return [new(2, nb, bs, nh, hs) for _ in range(nl)]
    if fmt is KVFormat.NL_X_NB_TWO_BS_NH_HS:
        return [new(nb, 2, bs, nh, hs) for _ in range(nl)]
    if fmt is KVFormat.NL_X_NB_BS_HS:
        return [new(nb, bs, hs) for _ in range(nl)]
    if fmt is KVFormat.TWO_X_NL_X_NBBS_NH_HS:
        return [[new(nb * bs, nh, hs) for _ in range(nl)] for _ in range(2)]
    if fmt is KVFormat.NL_X_NB_PAGE:  # vLLM's CPU cache: [NB, NH, BS, 2*HS] per layer
        return [new(nb, nh, bs, 2 * hs) for _ in range(nl)]
    return [new(nb * bs, 1, hs) for _ in range(nl)]


def clone_caches(kv_caches: KVCaches) -> KVCaches:
    """A deep copy with the same structure."""
    if isinstance(kv_caches, torch.Tensor):
        return kv_caches.clone()
    return [clone_caches(x) for x in kv_caches]  # type: ignore[return-value]


def caches_equal(a: KVCaches, b: KVCaches) -> bool:
    """Byte-exact equality of two caches of the same structure."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return all(caches_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]


__all__ = ["ALL_FORMATS", "ENGINE_OF", "caches_equal", "clone_caches", "make_kv_caches", "random_fill"]
