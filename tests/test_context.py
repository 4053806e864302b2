"""Round trips through the native copy, byte-exact against the plain-torch oracle."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import CacheContext, reference
from kvcache.errors import BlockIdError, ChunkMismatchError, LayoutError, TransferError
from kvcache.layouts import KVFormat
from kvcache.testing import (
    ALL_FORMATS,
    ENGINE_OF,
    caches_equal,
    clone_caches,
    make_kv_caches,
    random_fill,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
NB, BS, CHUNK = 24, 16, 64  # 4 blocks per chunk
POISON = 0xA5


def _ids(pattern: str, n: int, seed: int = 1) -> list[int]:
    if pattern == "contiguous":
        return list(range(3, 3 + n))
    rng = random.Random(seed)
    return rng.sample(range(NB), n)


def _ctx(
    fmt: KVFormat,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    head_size: int = 64,
    seed: int = 0,
    **kw: int,
) -> tuple[CacheContext, object]:
    caches = make_kv_caches(
        fmt,
        num_layers=3,
        num_blocks=NB,
        block_size=BS,
        num_heads=2,
        head_size=head_size,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    ctx = CacheContext(
        caches,
        chunk_size=CHUNK,
        fmt=fmt,
        engine=ENGINE_OF[fmt],
        block_size=BS,
        **kw,  # type: ignore[arg-type]
    )
    return ctx, caches


def _poisoned_chunks(
    ctx: CacheContext, n_blocks: int, device: str = "cpu", pin: bool = False
) -> list[torch.Tensor]:
    bpc = ctx.blocks_per_chunk
    sizes = [bpc] * (n_blocks // bpc) + ([n_blocks % bpc] if n_blocks % bpc else [])
    chunks = [ctx.allocate_chunks(1, device=device, pin_memory=pin, num_tokens=b * BS)[0] for b in sizes]
    for c in chunks:
        c.view(torch.uint8).fill_(POISON)
    return chunks


def _check_store(
    ctx: CacheContext, caches: object, ids: list[int], skip: int, device: str = "cpu", pin: bool = False
) -> None:
    chunks = _poisoned_chunks(ctx, len(ids), device, pin)
    ctx.copy_to_chunks(ids, chunks, skip_blocks=skip)
    got = torch.cat([c.cpu() for c in chunks], dim=2)
    want = reference.gather(caches, ctx.format, ctx.shape, ids).cpu()  # type: ignore[arg-type]
    skip_tokens = skip * BS
    assert torch.equal(got[:, :, skip_tokens:].view(torch.uint8), want[:, :, skip_tokens:].view(torch.uint8))
    # the skipped prefix is never written
    assert bool((got[:, :, :skip_tokens].contiguous().view(torch.uint8) == POISON).all())


def _check_retrieve(
    ctx: CacheContext, caches: object, ids: list[int], skip: int, device: str = "cpu", pin: bool = False
) -> None:
    source = clone_caches(caches)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(99)
    for t in CacheContext(source, chunk_size=CHUNK, fmt=ctx.format, block_size=BS).tensors:
        t.copy_(random_fill(torch.empty_like(t, device="cpu"), gen))
    payload = reference.gather(source, ctx.format, ctx.shape, ids)
    chunks = _poisoned_chunks(ctx, len(ids), device, pin)
    offset = 0
    for c in chunks:
        t = c.shape[2]
        c.copy_(payload[:, :, offset : offset + t].to(c.device))
        offset += t
    expected = clone_caches(caches)  # type: ignore[arg-type]
    reference.scatter(payload, expected, ctx.format, ctx.shape, ids, skip_blocks=skip)
    ctx.copy_from_chunks(chunks, ids, skip_blocks=skip)
    # every listed block (past the skip) is rewritten; every other byte is untouched
    assert caches_equal(caches, expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
@pytest.mark.parametrize("skip", [0, 5])
def test_store_matches_reference(fmt: KVFormat, dtype: torch.dtype, pattern: str, skip: int) -> None:
    ctx, caches = _ctx(fmt, dtype)
    _check_store(ctx, caches, _ids(pattern, 10), skip)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
@pytest.mark.parametrize("skip", [0, 5])
def test_retrieve_matches_reference(fmt: KVFormat, dtype: torch.dtype, pattern: str, skip: int) -> None:
    ctx, caches = _ctx(fmt, dtype)
    _check_retrieve(ctx, caches, _ids(pattern, 10), skip)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_round_trip_into_another_cache(fmt: KVFormat) -> None:
    src, src_caches = _ctx(fmt, seed=1)
    dst, dst_caches = _ctx(fmt, seed=2)
    ids_src, ids_dst = _ids("scattered", 8, seed=3), _ids("scattered", 8, seed=4)
    chunks = src.allocate_chunks(2)
    src.copy_to_chunks(ids_src, chunks)
    dst.copy_from_chunks(chunks, ids_dst)
    a = reference.gather(src_caches, fmt, src.shape, ids_src)  # type: ignore[arg-type]
    b = reference.gather(dst_caches, fmt, dst.shape, ids_dst)  # type: ignore[arg-type]
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "fmt, head_size, dtype",
    [
        (KVFormat.NL_X_TWO_NB_BS_NH_HS, 3, torch.float16),  # 6-byte heads: no 16 B unit
        (KVFormat.NL_X_NB_TWO_BS_NH_HS, 5, torch.float8_e4m3fn),  # odd bytes
        (KVFormat.NL_X_NB_BS_HS, 576, torch.bfloat16),  # MLA latent
        (KVFormat.NL_X_NBBS_ONE_HS, 576, torch.float8_e5m2),
    ],
)
def test_odd_sizes(fmt: KVFormat, head_size: int, dtype: torch.dtype) -> None:
    ctx, caches = _ctx(fmt, dtype, head_size=head_size)
    for ids in ([7], _ids("scattered", 6)):  # a single block; a short last chunk
        _check_store(ctx, caches, ids, skip=0)
        _check_retrieve(ctx, caches, ids, skip=0)


@pytest.mark.parametrize("bad", [NB, -1, 10**9])
@pytest.mark.parametrize("to_chunks", [True, False])
def test_out_of_range_block_id_changes_nothing(bad: int, to_chunks: bool) -> None:
    ctx, caches = _ctx(KVFormat.NL_X_TWO_NB_BS_NH_HS)
    before = clone_caches(caches)  # type: ignore[arg-type]
    chunks = _poisoned_chunks(ctx, 4)
    ids = [0, 1, bad, 3]
    with pytest.raises(BlockIdError, match=f"block id {bad} at position 2"):
        if to_chunks:
            ctx.copy_to_chunks(ids, chunks)
        else:
            ctx.copy_from_chunks(chunks, ids)
    assert caches_equal(caches, before)  # type: ignore[arg-type]
    assert bool((chunks[0].view(torch.uint8) == POISON).all())
    assert issubclass(BlockIdError, IndexError)


def test_chunk_mismatches_are_clear() -> None:
    ctx, _ = _ctx(KVFormat.NL_X_NB_TWO_BS_NH_HS)
    good = ctx.allocate_chunks(1)
    with pytest.raises(ChunkMismatchError, match="dtype"):
        ctx.copy_to_chunks(range(4), [torch.empty(ctx.chunk_shape(), dtype=torch.float32)])
    with pytest.raises(ChunkMismatchError, match="shape"):
        ctx.copy_to_chunks(range(4), [torch.empty(2, 3, 64, 7, dtype=torch.bfloat16)])
    with pytest.raises(ChunkMismatchError, match="4 blocks but 3"):
        ctx.copy_to_chunks(range(3), good)
    with pytest.raises(ChunkMismatchError, match="every chunk but the last"):
        ctx.copy_to_chunks(range(6), ctx.allocate_chunks(1, num_tokens=32) + good)
    with pytest.raises(ChunkMismatchError, match="whole number"):
        ctx.copy_to_chunks(range(1), ctx.allocate_chunks(1, num_tokens=8))
    with pytest.raises(ChunkMismatchError, match="contiguous"):
        nc = torch.empty(3, 2, 64, 128, dtype=torch.bfloat16).transpose(0, 1)
        ctx.copy_to_chunks(range(4), [nc])
    with pytest.raises(ChunkMismatchError, match="skip_blocks"):
        ctx.copy_to_chunks(range(4), good, skip_blocks=5)
    with pytest.raises(ChunkMismatchError, match="no chunks"):
        ctx.copy_to_chunks([], [])


def test_registration_errors() -> None:
    with pytest.raises(LayoutError, match="not contiguous"):
        CacheContext([torch.empty(16, 2, 64, 2, 8).transpose(0, 1)] * 2)
    with pytest.raises(LayoutError, match="dtype"):
        CacheContext([torch.empty(2, 4, 16, 2, 8), torch.empty(2, 4, 16, 2, 8).half()])
    with pytest.raises(LayoutError, match="shape"):
        CacheContext([torch.empty(2, 4, 16, 2, 8), torch.empty(2, 5, 16, 2, 8)])
    with pytest.raises(LayoutError, match="multiple of the block size"):
        CacheContext([torch.empty(2, 4, 16, 2, 8)], chunk_size=40)
    fmt = KVFormat.TWO_X_NL_X_NBBS_NH_HS
    with pytest.raises(LayoutError, match="block_size"):
        CacheContext(make_kv_caches(fmt, fill=False), engine="sglang")


def test_explicit_format_resolves_ambiguity() -> None:
    caches = [torch.empty(2, 2, 16, 2, 8, dtype=torch.float16) for _ in range(2)]
    ctx = CacheContext(caches, chunk_size=32, fmt=KVFormat.NL_X_NB_TWO_BS_NH_HS)
    assert ctx.format is KVFormat.NL_X_NB_TWO_BS_NH_HS
    assert ctx.num_blocks == 2


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_properties(fmt: KVFormat) -> None:
    ctx, _caches = _ctx(fmt, torch.float16, head_size=32)
    page = fmt is KVFormat.NL_X_NB_PAGE
    mla = fmt in (KVFormat.NL_X_NB_BS_HS, KVFormat.NL_X_NBBS_ONE_HS) or page
    heads = 1 if mla else 2
    head_size = 2 * 2 * 32 if page else 32
    assert ctx.format is fmt
    assert ctx.num_layers == 3
    assert ctx.num_blocks == NB
    assert ctx.block_size == BS
    assert ctx.num_heads == heads
    assert ctx.head_size == head_size
    assert ctx.kv_count == (1 if mla else 2)
    assert ctx.dtype == torch.float16
    assert ctx.device == torch.device("cpu")
    assert ctx.is_mla is mla
    assert ctx.chunk_size == CHUNK
    assert ctx.blocks_per_chunk == CHUNK // BS
    assert ctx.bytes_per_token == ctx.kv_count * 3 * heads * head_size * 2
    assert ctx.chunk_shape() == (ctx.kv_count, 3, CHUNK, heads * head_size)
    assert ctx.chunk_shape(16) == (ctx.kv_count, 3, 16, heads * head_size)
    assert ctx.chunk_nbytes(16) == 16 * ctx.bytes_per_token
    assert ctx.max_block_ids == 1 << 20
    assert ctx.shape.page_bytes == BS * heads * head_size * 2
    assert len(ctx.tensors) == (
        1 if fmt is KVFormat.NB_NL_TWO_BS_NH_HS else 6 if fmt is KVFormat.TWO_X_NL_X_NBBS_NH_HS else 3
    )
    chunks = ctx.allocate_chunks(2)
    assert len(chunks) == 2 and chunks[0].shape == ctx.chunk_shape()
    assert fmt.name in repr(ctx)
    ctx.synchronize()  # no-op on CPU


def test_copy_releases_the_gil_and_is_thread_safe() -> None:
    import threading

    ctx, caches = _ctx(KVFormat.NL_X_TWO_NB_BS_NH_HS)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for _ in range(20):
                _check_store(ctx, caches, _ids("scattered", 8, seed), skip=seed % 3)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# -- CUDA: same checks on the kernels (skipped without a GPU) ----------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
@pytest.mark.parametrize("chunk_place", ["device", "pinned"])
@pytest.mark.parametrize("skip", [0, 5])
def test_cuda_round_trip(fmt: KVFormat, dtype: torch.dtype, chunk_place: str, skip: int) -> None:
    ctx, caches = _ctx(fmt, dtype, device="cuda")
    device, pin = ("cuda", False) if chunk_place == "device" else ("cpu", True)
    for pattern in ("contiguous", "scattered"):
        _check_store(ctx, caches, _ids(pattern, 10), skip, device=device, pin=pin)
        _check_retrieve(ctx, caches, _ids(pattern, 10), skip, device=device, pin=pin)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "head_size, dtype", [(3, torch.float16), (5, torch.float8_e4m3fn), (576, torch.bfloat16)]
)
def test_cuda_odd_sizes(head_size: int, dtype: torch.dtype) -> None:
    fmt = KVFormat.NL_X_NB_BS_HS if head_size == 576 else KVFormat.NL_X_TWO_NB_BS_NH_HS
    ctx, caches = _ctx(fmt, dtype, device="cuda", head_size=head_size)
    for ids in ([7], _ids("scattered", 6)):
        _check_store(ctx, caches, ids, skip=0, device="cuda")
        _check_retrieve(ctx, caches, ids, skip=0, device="cuda")


@pytest.mark.cuda
def test_cuda_bad_ids_and_pageable_chunks() -> None:
    ctx, caches = _ctx(KVFormat.NL_X_TWO_NB_BS_NH_HS, device="cuda")
    before = clone_caches(caches)  # type: ignore[arg-type]
    chunks = _poisoned_chunks(ctx, 4, device="cuda")
    with pytest.raises(BlockIdError):
        ctx.copy_from_chunks(chunks, [0, 1, NB, 2])
    assert caches_equal(caches, before)  # type: ignore[arg-type]
    with pytest.raises(ChunkMismatchError, match="pageable"):
        ctx.copy_to_chunks(range(4), ctx.allocate_chunks(1))


@pytest.mark.cuda
def test_cuda_many_chunks_one_call() -> None:
    caches = make_kv_caches(
        KVFormat.NL_X_TWO_NB_BS_NH_HS,
        num_layers=2,
        num_blocks=4096,
        block_size=16,
        num_heads=1,
        head_size=16,
        device="cuda",
    )
    ctx = CacheContext(caches, chunk_size=16)  # one block per chunk: 4096 chunks
    ids = list(range(4095, -1, -1))
    chunks = ctx.allocate_chunks(len(ids), device="cuda")
    ctx.copy_to_chunks(ids, chunks)
    want = reference.gather(caches, ctx.format, ctx.shape, ids)
    # bytes, not values: random bf16 bits hold NaNs, and NaN != NaN (the first GPU run failed here)
    assert torch.equal(torch.cat(chunks, dim=2).view(torch.uint8), want.view(torch.uint8))


# -- the asynchronous face: job ids on the context's transfer handler --------------------


def test_async_copies_return_job_ids_on_the_contexts_handler() -> None:
    ctx, caches = _ctx(KVFormat.NL_X_TWO_NB_BS_NH_HS)
    ids, dst = _ids("scattered", 8), _ids("scattered", 8, seed=7)
    chunks = _poisoned_chunks(ctx, 8)
    want = reference.gather(caches, ctx.format, ctx.shape, ids).clone()  # type: ignore[arg-type]
    store = ctx.copy_to_chunks_async(ids, chunks)
    load = ctx.copy_from_chunks_async(chunks, dst)  # ordered after the store
    results = ctx.transfer.wait([store, load])
    assert [r.job_id for r in results] == [store, load] and all(r.ok for r in results)
    got = reference.gather(caches, ctx.format, ctx.shape, dst)  # type: ignore[arg-type]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    bad = ctx.copy_from_chunks_async(chunks, [0, 1, NB, 2, 3, 4, 5, 6])
    (result,) = ctx.transfer.wait([bad])
    assert isinstance(result.error, BlockIdError)


def test_results_count_blocks_past_the_skip_and_synchronize_drains() -> None:
    ctx, _ = _ctx(KVFormat.NL_X_NB_TWO_BS_NH_HS)
    (result,) = ctx.transfer.wait([ctx.copy_to_chunks_async(range(4), ctx.allocate_chunks(1), skip_blocks=1)])
    assert result.ok and result.blocks == 3 and result.bytes == 3 * BS * ctx.bytes_per_token
    pending = [ctx.copy_to_chunks_async(range(4), ctx.allocate_chunks(1)) for _ in range(3)]
    ctx.synchronize()
    assert [r.job_id for r in ctx.transfer.get_finished()] == pending
    assert ctx.geometry.chunk_shape() == ctx.chunk_shape()
    ctx.close()
    with pytest.raises(TransferError, match="closed"):
        ctx.copy_to_chunks(range(4), ctx.allocate_chunks(1))
