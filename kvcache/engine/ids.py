"""Request validation: the block ids of a store or retrieve cover its tokens and lie in the cache.

Separate from the data paths because both directions must refuse the same bad requests the same
way, and before anything is reserved or copied (a bad id raises; nothing has changed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvcache.context import GPUCacheContext
from kvcache.errors import BlockIdError, ChunkMismatchError

#: Token and block ids: a list, or a numpy int array (the daemon decodes packed arrays).
IntArray = Sequence[int] | np.ndarray


def check_cover(ctx: GPUCacheContext, num_tokens: int, block_ids: IntArray) -> None:
    """Raise ``ChunkMismatchError`` when ``block_ids`` are too few to hold ``num_tokens``."""
    need = math.ceil(num_tokens / ctx.block_size)
    if len(block_ids) < need:
        raise ChunkMismatchError(
            f"{len(block_ids)} block ids cannot hold {num_tokens} tokens "
            f"(block size {ctx.block_size}: need {need})"
        )


def block_id_array(ctx: GPUCacheContext, block_ids: IntArray, n: int) -> np.ndarray:
    """The first ``n`` block ids as int64, range-checked before anything is reserved."""
    ids = np.asarray(block_ids[:n], dtype=np.int64)
    if ids.ndim != 1:
        raise BlockIdError(f"block_ids must be one-dimensional, got shape {ids.shape}")
    if n and (int(ids.min()) < 0 or int(ids.max()) >= ctx.num_blocks):
        bad = int(np.flatnonzero((ids < 0) | (ids >= ctx.num_blocks))[0])
        raise BlockIdError(
            f"block id {int(ids[bad])} at position {bad} is outside [0, {ctx.num_blocks}); nothing was copied"
        )
    return ids


__all__ = ["IntArray", "block_id_array", "check_cover"]
