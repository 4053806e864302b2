"""Request validation: the block ids of a store or retrieve cover its tokens and lie in the cache.

Separate from the data paths because both directions must refuse the same bad requests the same
way, and before anything is reserved or copied (a bad id raises; nothing has changed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvcache.context import GPUCacheContext
from kvcache.errors import ChunkMismatchError
from kvcache.transfer.validate import block_id_array as checked_block_ids

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
    """The first ``n`` block ids as int64, range-checked before anything is reserved (by
    the transfer boundary's own rule, so both refuse the same ids with the same error)."""
    return checked_block_ids(block_ids[:n], ctx.num_blocks)


__all__ = ["IntArray", "block_id_array", "check_cover"]
