"""A checked job cut into pieces of whole chunks, and whether two jobs touch the same memory.

Separate from the CPU handler (which decides what runs when) because these are the two facts
its fairness rests on: a piece is a valid job of its own (the native copy needs no change),
and two jobs that share no block and no chunk (their ``Footprint``s) may run in either order,
or interleaved, with the same bytes as a result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvcache.transfer.validate import CheckedJob


@dataclass(frozen=True, eq=False)
class Footprint:
    """The memory a job touches: the engine blocks past its skip, and its chunks' addresses."""

    blocks: np.ndarray
    chunks: frozenset[int]

    @classmethod
    def of(cls, job: CheckedJob) -> Footprint:
        return cls(np.unique(job.block_ids[job.skip_blocks :]), frozenset(job.chunk_ptrs))

    # NOTE: a chunk is known by its start address; chunks of one pool never overlap
    # partially, as they are whole slots of the same size. Which jobs share memory is found
    # by the handler's index of the latest job per block and chunk (``cpu._prepare``).


def first_chunk(job: CheckedJob) -> int:
    """The first chunk with a block past the skip (the chunks before it move nothing)."""
    return min(job.skip_blocks // job.blocks_per_chunk, len(job.chunk_ptrs))


def piece(job: CheckedJob, start: int, stop: int, bytes_per_block: int) -> CheckedJob:
    """Chunks ``[start, stop)`` of ``job`` as a job of their own (the skip cut to fit)."""
    bpc = job.blocks_per_chunk
    lo, hi = start * bpc, min(stop * bpc, len(job.block_ids))
    skip = min(max(job.skip_blocks - lo, 0), hi - lo)
    blocks = hi - lo - skip
    return replace(
        job,
        block_ids=job.block_ids[lo:hi],
        chunk_ptrs=job.chunk_ptrs[start:stop],
        last_chunk_blocks=job.last_chunk_blocks if stop >= len(job.chunk_ptrs) else bpc,
        skip_blocks=skip,
        blocks=blocks,
        nbytes=blocks * bytes_per_block,
    )


def chunks_per_piece(piece_bytes: int, blocks_per_chunk: int, bytes_per_block: int) -> int:
    """How many whole chunks make a piece of at most ``piece_bytes`` (at least one)."""
    return max(1, piece_bytes // max(1, blocks_per_chunk * bytes_per_block))


__all__ = ["Footprint", "chunks_per_piece", "first_chunk", "piece"]
