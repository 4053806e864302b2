"""Job checks at the transfer boundary: ids converted and checked once, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache import _native
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    CudaUnavailableError,
    KvcacheError,
    LimitExceededError,
    TransferError,
)
from kvcache.ids import Ids
from kvcache.transfer import Direction, TransferJob, block_id_array
from kvcache.transfer.validate import check_job, native_error
from tests.transfer.helpers import NB, make_context


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        range(3),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.uint64),
        torch.tensor([3, 1, 2], dtype=torch.int16),
    ],
    ids=["list", "range", "int32", "uint64", "tensor"],
)
def test_integer_ids_become_contiguous_int64(ids: object) -> None:
    arr = block_id_array(ids, NB)  # type: ignore[arg-type]
    assert arr.dtype == np.int64 and arr.flags.c_contiguous and arr.tolist() == list(np.asarray(ids).tolist())


def test_empty_ids_are_an_empty_int64_array() -> None:
    assert block_id_array([], NB).dtype == np.int64


@pytest.mark.parametrize(
    "ids, match",
    [
        ([0, 1.5], "integers"),
        (np.array([0.0, 1.0]), "integers"),
        (torch.tensor([0.0, 1.0]), "integers"),
        (torch.tensor([True, False]), "integers"),
        ([[0, 1], [2, 3]], "one-dimensional"),
        ([0, 1, NB], f"block id {NB} at position 2"),
        ([-1], "block id -1 at position 0"),
        (np.array([1, 2**63], dtype=np.uint64), f"block id {2**63} at position 1"),
        ([0, 2**70], "integers"),
    ],
)
def test_bad_ids_raise_block_id_error(ids: object, match: str) -> None:
    with pytest.raises(BlockIdError, match=match):
        block_id_array(ids, NB)  # type: ignore[arg-type]
    assert issubclass(BlockIdError, IndexError)


def test_check_job_counts_bytes_and_blocks_past_the_skip() -> None:
    ctx = make_context()
    chunks = ctx.allocate_chunks(1) + ctx.allocate_chunks(1, num_tokens=32)  # 4 + 2 blocks
    checked = check_job(TransferJob(Direction.FROM_CHUNKS, list(range(6)), tuple(chunks), 1), ctx.geometry)
    assert (checked.blocks_per_chunk, checked.last_chunk_blocks, checked.skip_blocks) == (4, 2, 1)
    assert checked.blocks == 5 and checked.nbytes == 5 * ctx.block_size * ctx.bytes_per_token
    assert checked.to_chunks is False
    assert checked.chunk_ptrs == [c.data_ptr() for c in chunks]


def test_checked_ids_pass_unchanged_and_others_are_checked_once_here() -> None:
    """A request's ids were checked when it was built: the job takes them as they are; ids
    checked against a larger cache (or handed in raw) go through the one check."""
    ctx = make_context()
    chunks = tuple(ctx.allocate_chunks(1))
    ids = Ids.blocks([3, 1, 2, 0], NB)
    assert check_job(TransferJob(Direction.TO_CHUNKS, ids, chunks), ctx.geometry).block_ids is ids.values
    wider = Ids.blocks([0, 1, 2, NB], NB + 1)
    with pytest.raises(BlockIdError, match=f"block id {NB} at position 3"):
        check_job(TransferJob(Direction.TO_CHUNKS, wider, chunks), ctx.geometry)


def test_check_job_refuses_what_does_not_fit() -> None:
    ctx = make_context()
    good = tuple(ctx.allocate_chunks(1))
    with pytest.raises(ChunkMismatchError, match="skip_blocks"):
        check_job(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], good, 5), ctx.geometry)
    with pytest.raises(ChunkMismatchError, match="no chunks"):
        check_job(TransferJob(Direction.TO_CHUNKS, [], ()), ctx.geometry)
    small = type(ctx.geometry)(**{**ctx.geometry.__dict__, "max_block_ids": 3})
    with pytest.raises(LimitExceededError, match="max_block_ids"):
        check_job(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], good), small)


@pytest.mark.parametrize(
    "raised, expected",
    [
        (_native.BlockIdOutOfRange("block id 40 at position 0 is outside [0, 32)"), BlockIdError),
        (_native.CudaUnavailable("no CUDA"), CudaUnavailableError),
        (ValueError("sizes"), ChunkMismatchError),
        (RuntimeError("an illegal memory access was encountered"), TransferError),
    ],
)
def test_native_errors_become_kvcache_errors(raised: Exception, expected: type) -> None:
    err = native_error(raised)
    assert isinstance(err, expected) and isinstance(err, KvcacheError)
    assert str(raised) in str(err)
    kept = BlockIdError("already typed")
    assert native_error(kept) is kept
