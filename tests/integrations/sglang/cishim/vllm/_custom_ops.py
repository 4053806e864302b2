"""Test-only: the one vLLM op SGLang's non-CUDA rotary fallback imports, in plain torch."""

import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):  # type: ignore[no-untyped-def]
    """In-place RoPE on ``query`` and ``key``."""
    pos = positions.flatten()
    cs = cos_sin_cache.index_select(0, pos).float()
    cos, sin = cs.chunk(2, dim=-1)

    def rot(x):  # type: ignore[no-untyped-def]
        x = x.view(pos.numel(), -1, head_size)
        rd = cos.shape[-1] * 2
        xr = x[..., :rd].float()
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
        else:
            x1, x2 = xr[..., ::2], xr[..., 1::2]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.cat([o1, o2], -1) if is_neox else torch.stack([o1, o2], -1).flatten(-2)
        x[..., :rd] = out.to(x.dtype)

    rot(query)
    if key is not None:
        rot(key)
