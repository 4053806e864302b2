"""The CUDA kernel's body, run over its launch grid on the CPU (``_native.emulate_kernel``),
byte-exact against the plain-torch oracle for every layout, word size and skip value the
CPU twin is tested with. The kernel, the emulation and the CPU twin share one address
function (csrc/kvc_page.h), so this checks the kernel's own offsets without a GPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcache import CacheContext, _native, reference
from kvcache.errors import BlockIdError
from kvcache.layouts import KVFormat
from kvcache.testing import ALL_FORMATS, ENGINE_OF, caches_equal, clone_caches, make_kv_caches
from tests.transfer.helpers import page_table

NB = 24
POISON = 0xA5
# (dtype, heads, head size, block size) -> the word the launcher picks: 16, 4, 2, 1 bytes
# (pages of 2048, 24 or 12, 6 and 5 bytes; MLA layouts have one head)
WORDS = [
    (torch.bfloat16, 2, 64, 16, 16),
    (torch.float32, 2, 3, 1, 4),
    (torch.float16, 1, 3, 1, 2),
    (torch.float8_e4m3fn, 1, 5, 1, 1),
]


def _ctx(
    fmt: KVFormat, dtype: torch.dtype, heads: int, head_size: int, bs: int
) -> tuple[CacheContext, object]:
    caches = make_kv_caches(
        fmt, num_layers=3, num_blocks=NB, block_size=bs, num_heads=heads, head_size=head_size, dtype=dtype
    )
    ctx = CacheContext(caches, chunk_size=4 * bs, fmt=fmt, engine=ENGINE_OF[fmt], block_size=bs)
    return ctx, caches


def _chunks(ctx: CacheContext, n_blocks: int) -> list[torch.Tensor]:
    bpc = ctx.blocks_per_chunk
    sizes = [bpc] * (n_blocks // bpc) + ([n_blocks % bpc] if n_blocks % bpc else [])
    chunks = [ctx.allocate_chunks(1, num_tokens=b * ctx.block_size)[0] for b in sizes]
    for c in chunks:
        c.view(torch.uint8).fill_(POISON)
    return chunks


def _emulate(
    ctx: CacheContext, ids: list[int], chunks: list[torch.Tensor], skip: int, to_chunks: bool
) -> int:
    table = page_table(ctx)
    ptrs = [c.data_ptr() for c in chunks]
    last = chunks[-1].shape[2] // ctx.block_size
    unit = _native.emulate_kernel(
        table, np.asarray(ids, dtype=np.int64), ptrs, ctx.blocks_per_chunk, last, skip, to_chunks
    )
    assert unit == _native.copy_unit_bytes(table, ptrs)
    return unit


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype, heads, head_size, bs, word", WORDS, ids=lambda v: str(v))
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
@pytest.mark.parametrize("skip", [0, 5])
def test_emulated_kernel_matches_the_oracle(
    fmt: KVFormat,
    dtype: torch.dtype,
    heads: int,
    head_size: int,
    bs: int,
    word: int,
    pattern: str,
    skip: int,
) -> None:
    ctx, caches = _ctx(fmt, dtype, heads, head_size, bs)
    ids = list(range(3, 13)) if pattern == "contiguous" else random.Random(1).sample(range(NB), 10)
    # store: engine -> chunks; the skipped prefix is never written
    chunks = _chunks(ctx, len(ids))
    unit = _emulate(ctx, ids, chunks, skip, to_chunks=True)
    assert unit == word or fmt is KVFormat.NL_X_NB_PAGE  # opaque pages: K and V in one page
    got = torch.cat(chunks, dim=2)
    want = reference.gather(caches, fmt, ctx.shape, ids)  # type: ignore[arg-type]
    s = skip * bs
    assert torch.equal(
        got[:, :, s:].contiguous().view(torch.uint8), want[:, :, s:].contiguous().view(torch.uint8)
    )
    assert bool((got[:, :, :s].contiguous().view(torch.uint8) == POISON).all())
    # load: chunks -> engine; listed blocks past the skip rewritten, every other byte kept
    payload = torch.cat(chunks, dim=2).clone()
    payload.view(torch.uint8).bitwise_xor_(0x3C)
    offset = 0
    for c in chunks:
        c.copy_(payload[:, :, offset : offset + c.shape[2]])
        offset += c.shape[2]
    expected = clone_caches(caches)  # type: ignore[arg-type]
    reference.scatter(payload, expected, fmt, ctx.shape, ids, skip_blocks=skip)
    _emulate(ctx, ids, chunks, skip, to_chunks=False)
    assert caches_equal(caches, expected)  # type: ignore[arg-type]


def test_emulation_refuses_bad_ids_before_any_byte_moves() -> None:
    ctx, caches = _ctx(KVFormat.NL_X_TWO_NB_BS_NH_HS, torch.bfloat16, 2, 64, 16)
    before = clone_caches(caches)  # type: ignore[arg-type]
    chunks = _chunks(ctx, 4)
    with pytest.raises(IndexError, match=f"block id {NB} at position 2"):
        _emulate(ctx, [0, 1, NB, 3], chunks, 0, to_chunks=False)
    assert caches_equal(caches, before)  # type: ignore[arg-type]
    assert issubclass(_native.BlockIdOutOfRange, IndexError) and not issubclass(
        BlockIdError, _native.BlockIdOutOfRange
    )
