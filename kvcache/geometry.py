"""Geometry: the one description of a registered cache's sizes, everything a copy needs
besides addresses.

One type from layout detection to the copy check: ``layouts.describe`` reads it from the
engine's tensors, ``CacheContext`` keeps it (and so does the daemon's registration record), a
request is checked against it (``CacheEngine.geometry``, in the daemon the record's), the
transfer handlers check every job against it, and the engine keys chunks by its chunk shape. It
used to be three (``KVShape`` for the tensors, ``ChunkGeometry`` for the copy contract, the
context's own fields) that had to agree.

A leaf: torch and the error tree only, so every layer can import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.errors import LayoutError

DEFAULT_MAX_BLOCK_IDS = 1 << 20
"""Block ids one job may name, unless the registration says otherwise."""


@dataclass(frozen=True)
class Geometry:
    """One registered cache: its blocks, the tensors' element type and where they live, and
    the chunks kvcache keeps of them.

    A block is ``block_size`` tokens of every layer (``num_layers``) and of K and V
    (``kv_count``: 2, or 1 for MLA and opaque pages), each token ``num_heads * head_size``
    elements of ``dtype``. A chunk is ``[kv_count, num_layers, tokens, token_width]`` of
    ``dtype``; it holds at most ``chunk_size`` tokens, a whole number of blocks (checked
    here, at construction). A job names at most ``max_block_ids`` block ids.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    kv_count: int
    dtype: torch.dtype
    device: torch.device
    chunk_size: int
    max_block_ids: int = DEFAULT_MAX_BLOCK_IDS

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise LayoutError(
                f"chunk_size {self.chunk_size} must be a positive multiple of the block size "
                f"{self.block_size}"
            )

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def token_width(self) -> int:
        """Elements per token of one (kv, layer): heads * head_size."""
        return self.num_heads * self.head_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one (layer, kv) pair: contiguous in every layout."""
        return self.block_size * self.token_width * self.element_size

    @property
    def bytes_per_token(self) -> int:
        return self.kv_count * self.num_layers * self.token_width * self.element_size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id moves: every layer and K/V of its tokens."""
        return self.block_size * self.bytes_per_token

    def chunk_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int]:
        tokens = self.chunk_size if num_tokens is None else num_tokens
        return (self.kv_count, self.num_layers, tokens, self.token_width)


__all__ = ["DEFAULT_MAX_BLOCK_IDS", "Geometry"]
