"""GPUCacheContext: one registered engine KV cache and the copies in and out of it.

Registration does the expensive, fixed work once (layout detection, validation, the
native page table of addresses, device buffers for block ids, the copy stream) so that
each store or retrieve only stages block ids and launches one copy. Works for CUDA and
CPU tensors alike: CPU caches go through the native CPU twin, CUDA caches through the
kernels. Thread-safe: copies may be issued from several threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvcache import _native
from kvcache.errors import BlockIdError, ChunkMismatchError, CudaUnavailableError, LayoutError
from kvcache.layouts import (
    LAYOUT_ROWS,
    GPUKVFormat,
    KVCaches,
    KVShape,
    describe,
    detect_format,
    flatten_tensors,
)

DEFAULT_MAX_BLOCK_IDS = 1 << 20
BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def _as_id_array(block_ids: BlockIds) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        arr = block_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(block_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise BlockIdError(f"block_ids must be one-dimensional, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


class GPUCacheContext:
    """A registered KV cache: geometry, addresses, and block-id copies to/from chunks.

    A chunk is kvcache's own tensor ``[KV, NL, T, NH*HS]`` (KV = 2 for K/V layouts, 1 for
    MLA); T tokens take T / block_size consecutive entries of the block-id list.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        chunk_size: int = 256,
        fmt: GPUKVFormat | None = None,
        engine: str = "vllm",
        block_size: int | None = None,
        max_block_ids: int = DEFAULT_MAX_BLOCK_IDS,
        num_threads: int = 0,
    ) -> None:
        self._format = GPUKVFormat(fmt) if fmt is not None else detect_format(kv_caches, engine)
        tensors = flatten_tensors(kv_caches, self._format)
        self._check_tensors(tensors)
        self._shape = describe(tensors, self._format, block_size)
        if chunk_size <= 0 or chunk_size % self._shape.block_size:
            raise LayoutError(
                f"chunk_size {chunk_size} must be a positive multiple of the block size "
                f"{self._shape.block_size}"
            )
        self._chunk_size = chunk_size
        self._tensors = tensors  # keeps the engine memory alive while registered
        self._dtype = tensors[0].dtype
        self._device = tensors[0].device
        self._num_threads = num_threads
        self._table = _native.PageTable(
            int(self._format),
            self._shape.num_layers,
            self._shape.num_blocks,
            self._shape.page_bytes,
            [t.data_ptr() for t in tensors],
        )
        self._cuda: Any = None
        self._stream: Any = None
        if self._device.type == "cuda":
            if not _native.cuda_compiled():
                raise CudaUnavailableError(
                    "CUDA tensors were registered but kvcache was built without CUDA "
                    "(rebuild with KVCACHE_BUILD_CUDA=1)"
                )
            index = self._device.index if self._device.index is not None else 0
            max_chunks = max(1, -(-max_block_ids // self.blocks_per_chunk))
            self._cuda = _native.CudaTransfer(self._table, index, max_block_ids, max_chunks)
            self._stream = torch.cuda.Stream(device=self._device)
        self._max_block_ids = max_block_ids

    @staticmethod
    def _check_tensors(tensors: list[torch.Tensor]) -> None:
        first = tensors[0]
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise LayoutError(f"KV tensor {i} is not contiguous")
            if t.device != first.device:
                raise LayoutError(f"KV tensor {i} is on {t.device}, tensor 0 on {first.device}")
            if t.dtype != first.dtype:
                raise LayoutError(f"KV tensor {i} has dtype {t.dtype}, tensor 0 has {first.dtype}")
            if t.shape != first.shape:
                raise LayoutError(
                    f"KV tensor {i} has shape {tuple(t.shape)}, tensor 0 has {tuple(first.shape)}"
                )
        if first.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"KV tensors on {first.device} are not supported (cpu or cuda)")

    # -- geometry -------------------------------------------------------------------
    @property
    def format(self) -> GPUKVFormat:
        return self._format

    @property
    def shape(self) -> KVShape:
        return self._shape

    @property
    def num_layers(self) -> int:
        return self._shape.num_layers

    @property
    def num_blocks(self) -> int:
        return self._shape.num_blocks

    @property
    def block_size(self) -> int:
        return self._shape.block_size

    @property
    def num_heads(self) -> int:
        return self._shape.num_heads

    @property
    def head_size(self) -> int:
        return self._shape.head_size

    @property
    def kv_count(self) -> int:
        return self._shape.kv_count

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_mla(self) -> bool:
        return LAYOUT_ROWS[self._format].kv == 1

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def blocks_per_chunk(self) -> int:
        return self._chunk_size // self._shape.block_size

    @property
    def bytes_per_token(self) -> int:
        return self._shape.bytes_per_token

    @property
    def max_block_ids(self) -> int:
        return self._max_block_ids

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The engine tensors in layout-table order (do not resize them while registered)."""
        return list(self._tensors)

    def chunk_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int]:
        tokens = self._chunk_size if num_tokens is None else num_tokens
        return (self.kv_count, self.num_layers, tokens, self.num_heads * self.head_size)

    def chunk_nbytes(self, num_tokens: int | None = None) -> int:
        tokens = self._chunk_size if num_tokens is None else num_tokens
        return tokens * self.bytes_per_token

    def allocate_chunks(
        self,
        n: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        num_tokens: int | None = None,
    ) -> list[torch.Tensor]:
        """``n`` empty chunks; pinned host chunks let CUDA caches copy without staging."""
        pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
        return [
            torch.empty(self.chunk_shape(num_tokens), dtype=self._dtype, device=device, pin_memory=pin)
            for _ in range(n)
        ]

    # -- copies ---------------------------------------------------------------------
    def copy_to_chunks(
        self, block_ids: BlockIds, chunks: Sequence[torch.Tensor], skip_blocks: int = 0
    ) -> None:
        """Engine blocks -> chunks (store). The first ``skip_blocks`` ids are not copied."""
        self._copy(block_ids, chunks, skip_blocks, to_chunks=True)

    def copy_from_chunks(
        self, chunks: Sequence[torch.Tensor], block_ids: BlockIds, skip_blocks: int = 0
    ) -> None:
        """Chunks -> engine blocks (retrieve). The first ``skip_blocks`` blocks are left as
        they are: the engine already holds them."""
        self._copy(block_ids, chunks, skip_blocks, to_chunks=False)

    def synchronize(self) -> None:
        """Wait for every copy this context issued (a no-op for CPU caches)."""
        if self._stream is not None:
            self._stream.synchronize()

    def _copy(
        self, block_ids: BlockIds, chunks: Sequence[torch.Tensor], skip_blocks: int, to_chunks: bool
    ) -> None:
        ids = _as_id_array(block_ids)
        chunk_list = list(chunks)
        last_blocks = self._check_chunks(chunk_list)
        expected = (len(chunk_list) - 1) * self.blocks_per_chunk + last_blocks
        if len(ids) != expected:
            raise ChunkMismatchError(
                f"{len(chunk_list)} chunk(s) hold {expected} blocks but {len(ids)} block ids were given"
            )
        if not 0 <= skip_blocks <= len(ids):
            raise ChunkMismatchError(f"skip_blocks={skip_blocks} is outside [0, {len(ids)}]")
        self._check_ids(ids)
        ptrs = [c.data_ptr() for c in chunk_list]
        try:
            if self._cuda is None:
                _native.cpu_copy(
                    self._table,
                    ids,
                    ptrs,
                    self.blocks_per_chunk,
                    last_blocks,
                    skip_blocks,
                    to_chunks,
                    self._num_threads,
                )
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self._device))
                self._cuda.copy(
                    ids,
                    ptrs,
                    self.blocks_per_chunk,
                    last_blocks,
                    skip_blocks,
                    to_chunks,
                    self._stream.cuda_stream,
                )
                self._stream.synchronize()
        except _native.BlockIdOutOfRange as err:  # defence in depth: native re-checks
            raise BlockIdError(str(err)) from err
        except _native.CudaUnavailable as err:
            raise CudaUnavailableError(str(err)) from err
        except ValueError as err:
            raise ChunkMismatchError(str(err)) from err

    def _check_ids(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        bad = np.flatnonzero((ids < 0) | (ids >= self.num_blocks))
        if len(bad):
            pos = int(bad[0])
            raise BlockIdError(
                f"block id {int(ids[pos])} at position {pos} is outside [0, {self.num_blocks}); "
                "nothing was copied"
            )

    def _check_chunks(self, chunks: list[torch.Tensor]) -> int:
        """Validates every chunk and returns the number of blocks in the last one."""
        if not chunks:
            raise ChunkMismatchError("no chunks given")
        bs = self.block_size
        last_blocks = 0
        for i, c in enumerate(chunks):
            if c.dtype != self._dtype:
                raise ChunkMismatchError(f"chunk {i} has dtype {c.dtype}, the cache {self._dtype}")
            if not c.is_contiguous():
                raise ChunkMismatchError(f"chunk {i} is not contiguous")
            if (
                c.dim() != 4
                or tuple(c.shape[:2]) != (self.kv_count, self.num_layers)
                or c.shape[3] != self.num_heads * self.head_size
            ):
                raise ChunkMismatchError(
                    f"chunk {i} has shape {tuple(c.shape)}, expected {self.chunk_shape()} "
                    "(the token axis may be shorter for the last chunk)"
                )
            tokens = c.shape[2]
            is_last = i == len(chunks) - 1
            if (
                (not is_last and tokens != self._chunk_size)
                or tokens <= 0
                or tokens % bs
                or (tokens > self._chunk_size)
            ):
                raise ChunkMismatchError(
                    f"chunk {i} holds {tokens} tokens: every chunk but the last must hold "
                    f"{self._chunk_size}, and the last a whole number of {bs}-token blocks"
                )
            self._check_chunk_device(i, c)
            last_blocks = tokens // bs
        return last_blocks

    def _check_chunk_device(self, i: int, c: torch.Tensor) -> None:
        if self._device.type == "cpu":
            if c.device.type != "cpu":
                raise ChunkMismatchError(f"chunk {i} is on {c.device}; this cache is on the CPU")
            return
        if c.device.type == "cuda":
            if c.device != self._device:
                raise ChunkMismatchError(f"chunk {i} is on {c.device}, the cache on {self._device}")
        elif not c.is_pinned():
            raise ChunkMismatchError(
                f"chunk {i} is in pageable host memory: CUDA copies need device or pinned chunks"
            )

    def __repr__(self) -> str:
        return (
            f"GPUCacheContext(format={self._format.name}, layers={self.num_layers}, "
            f"blocks={self.num_blocks}, block_size={self.block_size}, heads={self.num_heads}, "
            f"head_size={self.head_size}, dtype={self._dtype}, device={self._device}, "
            f"chunk_size={self._chunk_size})"
        )


__all__ = ["DEFAULT_MAX_BLOCK_IDS", "GPUCacheContext"]
