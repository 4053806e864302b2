"""Job checks at the transfer boundary: chunks, and how the block ids cover them.

Separate from the handlers because every backend must refuse the same bad jobs with the
same typed errors before any byte moves. Block ids checked already (``ids.Ids`` of a request,
checked against this cache) are taken as they are; ids a direct caller hands in are checked by
the same function (``ids.block_id_array``); the native code re-checks ids as defence in
depth, and ``native_error`` is the one place its exceptions become kvcache errors. Failures
of CUDA itself (torch.cuda, the driver, the native CUDA module), wherever they surface (the
CUDA handler, the daemon's IPC, the context), become kvcache errors in ``cuda_error`` alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import _native
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    CudaError,
    CudaUnavailableError,
    DeadlineExceededError,
    KvcacheError,
    LimitExceededError,
    TransferError,
)
from kvcache.geometry import Geometry
from kvcache.ids import Ids, block_id_array
from kvcache.transfer.base import BlockIds, Direction, TransferJob


@dataclass(frozen=True)
class CheckedJob:
    """A job that passed every check, in the form the native copy takes."""

    block_ids: np.ndarray  # int64, one-dimensional, contiguous, each in [0, num_blocks)
    chunk_ptrs: list[int]
    blocks_per_chunk: int
    last_chunk_blocks: int
    skip_blocks: int
    to_chunks: bool
    blocks: int  # ids past the skip: the blocks this job moves
    nbytes: int

    def native_args(self) -> tuple[np.ndarray, list[int], int, int, int, bool]:
        """The copy's arguments as every native CPU copy takes them, after the page table."""
        return (
            self.block_ids,
            self.chunk_ptrs,
            self.blocks_per_chunk,
            self.last_chunk_blocks,
            self.skip_blocks,
            self.to_chunks,
        )


def check_start(job: TransferJob) -> None:
    """Raise ``DeadlineExceededError`` when ``job`` may no longer start (its deadline passed)."""
    if job.deadline is not None and job.deadline.passed():
        raise DeadlineExceededError(
            "the copy's start deadline passed before its turn came; nothing was copied"
        )


def check_job(job: TransferJob, geom: Geometry) -> CheckedJob:
    """Every check a job needs before a byte moves; raises the typed error of the first
    failure (chunks first, then how the ids cover them, then the ids themselves)."""
    chunks = list(job.chunks)
    last_blocks = _check_chunks(chunks, geom)
    bpc = geom.blocks_per_chunk
    expected = (len(chunks) - 1) * bpc + last_blocks
    n = len(job.block_ids)
    if n != expected:
        raise ChunkMismatchError(
            f"{len(chunks)} chunk(s) hold {expected} blocks but {n} block ids were given"
        )
    if n > geom.max_block_ids:
        raise LimitExceededError(f"{n} block ids exceed the context's max_block_ids ({geom.max_block_ids})")
    if not 0 <= job.skip_blocks <= n:
        raise ChunkMismatchError(f"skip_blocks={job.skip_blocks} is outside [0, {n}]")
    ids = _checked_ids(job.block_ids, geom.num_blocks)
    blocks = n - job.skip_blocks
    return CheckedJob(
        block_ids=ids,
        chunk_ptrs=[c.data_ptr() for c in chunks],
        blocks_per_chunk=bpc,
        last_chunk_blocks=last_blocks,
        skip_blocks=job.skip_blocks,
        to_chunks=job.direction is Direction.TO_CHUNKS,
        blocks=blocks,
        nbytes=blocks * geom.bytes_per_block,
    )


def _checked_ids(block_ids: BlockIds, num_blocks: int) -> np.ndarray:
    """A request's ids as they are (checked against a cache no larger than this one when the
    request was built), anything else through the one check."""
    if isinstance(block_ids, Ids) and block_ids.bound is not None and block_ids.bound <= num_blocks:
        return block_ids.values
    return block_id_array(block_ids, num_blocks)


def _check_chunks(chunks: list[torch.Tensor], geom: Geometry) -> int:
    """Validates every chunk and returns the number of blocks in the last one."""
    if not chunks:
        raise ChunkMismatchError("no chunks given")
    bs = geom.block_size
    last_blocks = 0
    for i, c in enumerate(chunks):
        if c.dtype != geom.dtype:
            raise ChunkMismatchError(f"chunk {i} has dtype {c.dtype}, the cache {geom.dtype}")
        if not c.is_contiguous():
            raise ChunkMismatchError(f"chunk {i} is not contiguous")
        if (
            c.dim() != 4
            or tuple(c.shape[:2]) != (geom.kv_count, geom.num_layers)
            or c.shape[3] != geom.token_width
        ):
            raise ChunkMismatchError(
                f"chunk {i} has shape {tuple(c.shape)}, expected {geom.chunk_shape()} "
                "(the token axis may be shorter for the last chunk)"
            )
        tokens = c.shape[2]
        is_last = i == len(chunks) - 1
        if (not is_last and tokens != geom.chunk_size) or not 0 < tokens <= geom.chunk_size or tokens % bs:
            raise ChunkMismatchError(
                f"chunk {i} holds {tokens} tokens: every chunk but the last must hold "
                f"{geom.chunk_size}, and the last a whole number of {bs}-token blocks"
            )
        _check_chunk_device(i, c, geom.device)
        last_blocks = tokens // bs
    return last_blocks


def _check_chunk_device(i: int, c: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        if c.device.type != "cpu":
            raise ChunkMismatchError(f"chunk {i} is on {c.device}; this cache is on the CPU")
        return
    if c.device.type == "cuda":
        if c.device != device:
            raise ChunkMismatchError(f"chunk {i} is on {c.device}, the cache on {device}")
    elif not c.is_pinned():
        raise ChunkMismatchError(
            f"chunk {i} is in pageable host memory: CUDA copies need device or pinned chunks"
        )


def native_error(err: Exception) -> KvcacheError:
    """The kvcache error for an exception raised by a native copy or a device fault."""
    if isinstance(err, KvcacheError):
        return err
    if isinstance(err, _native.BlockIdOutOfRange):
        return BlockIdError(str(err))
    if isinstance(err, _native.CudaUnavailable):
        return cuda_error(err, "copy")
    if isinstance(err, ValueError):
        return ChunkMismatchError(str(err))
    return TransferError(f"copy failed: {type(err).__name__}: {err}")


_NO_CUDA = (
    "not compiled with cuda",
    "requires cuda support",
    "no nvidia driver",
    "no cuda gpus are available",
    "cuda driver version is insufficient",
    "built without cuda",
)


def cuda_error(err: BaseException, doing: str) -> KvcacheError:
    """The kvcache error for a failure of CUDA while ``doing`` (a phrase: "opening the CUDA
    IPC event"): the one place such failures are translated.

    ``CudaUnavailableError`` when there is no usable CUDA at all (a CPU build of kvcache or
    torch, no driver library, no device: ``torch.cuda`` raises AssertionError or a plain
    RuntimeError then); ``CudaError`` for the rest (a device fault, out of device memory, a
    handle CUDA refused). A kvcache error is returned as it is.
    """
    if isinstance(err, KvcacheError):
        return err
    text = str(err)
    unavailable = (
        isinstance(err, (_native.CudaUnavailable, OSError))
        or any(marker in text.lower() for marker in _NO_CUDA)
        or not torch.cuda.is_available()
    )
    if unavailable:
        return CudaUnavailableError(f"{doing}: {text}")
    return CudaError(f"{doing}: {type(err).__name__}: {text}")


@contextmanager
def cuda_errors(doing: str) -> Iterator[None]:
    """Raise ``cuda_error(err, doing)`` for whatever the block raises (wrap CUDA calls only:
    every failure inside is taken for CUDA's)."""
    try:
        yield
    except KvcacheError:
        raise
    except Exception as err:
        raise cuda_error(err, doing) from err


__all__ = [
    "CheckedJob",
    "block_id_array",
    "check_job",
    "check_start",
    "cuda_error",
    "cuda_errors",
    "native_error",
]
