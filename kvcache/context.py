"""CacheContext: one registered engine KV cache and the copies in and out of it.

Registration does the expensive, fixed work once (layout detection, validation, the
native page table of addresses, the transfer handler with its device buffers and stream)
so that each store or retrieve is one job submitted to that handler, which checks it and
moves the bytes (``kvcache.transfer``: the native CPU twin on a worker thread for CPU
caches, the kernels on the handler's stream for CUDA caches). The ``*_async`` methods
return the job id; the plain ones wait for it. Thread-safe: copies may be issued from
several threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcache import _native
from kvcache.deadline import Deadline
from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.geometry import DEFAULT_MAX_BLOCK_IDS, Geometry
from kvcache.layouts import (
    LAYOUT_ROWS,
    KVCaches,
    KVFormat,
    check_page_bounds,
    describe,
    detect_format,
    flatten_tensors,
)
from kvcache.transfer.base import BlockIds, CopyPriority, Direction, TransferHandler, TransferJob
from kvcache.transfer.cpu import CpuTransferHandler
from kvcache.transfer.validate import cuda_errors


class CacheContext:
    """A registered KV cache: geometry, addresses, and block-id copies to/from chunks.

    A chunk is kvcache's own tensor ``[KV, NL, T, NH*HS]`` (KV = 2 for K/V layouts, 1 for
    MLA); T tokens take T / block_size consecutive entries of the block-id list.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        chunk_size: int = 256,
        fmt: KVFormat | None = None,
        engine: str = "vllm",
        block_size: int | None = None,
        max_block_ids: int = DEFAULT_MAX_BLOCK_IDS,
        num_threads: int = 0,
        priority: CopyPriority | None = None,
    ) -> None:
        self._format = KVFormat(fmt) if fmt is not None else detect_format(kv_caches, engine)
        tensors = flatten_tensors(kv_caches, self._format)
        self._check_tensors(tensors)
        self._geometry = geometry = describe(
            tensors, self._format, block_size, chunk_size=chunk_size, max_block_ids=max_block_ids
        )
        self._tensors = tensors  # keeps the engine memory alive while registered
        tensor_bytes = [t.numel() * t.element_size() for t in tensors]  # contiguous: checked
        check_page_bounds(self._format, geometry, tensor_bytes)
        try:
            self._table = _native.PageTable(
                int(self._format),
                geometry.num_layers,
                geometry.num_blocks,
                geometry.page_bytes,
                [t.data_ptr() for t in tensors],
                tensor_bytes,
            )
        except ValueError as exc:  # the native guard: reached only if the check above missed
            raise LayoutError(str(exc)) from exc
        self._handler: TransferHandler = self._make_handler(geometry, num_threads, priority)

    def _make_handler(
        self, geometry: Geometry, num_threads: int, priority: CopyPriority | None
    ) -> TransferHandler:
        """``priority``: where the CPU handler reports its copying and asks whether it gives
        way to other work (its pieces then run in the lowest CPU class). A CUDA cache's copies
        run on the device, not on a core of the daemon, and ignore it."""
        if self._geometry.device.type == "cpu":
            return CpuTransferHandler(
                self._table, geometry, num_threads, owners=self._tensors, priority=priority
            )
        if not _native.cuda_compiled():
            raise CudaUnavailableError(
                "CUDA tensors were registered but kvcache was built without CUDA "
                "(rebuild with KVCACHE_BUILD_CUDA=1)"
            )
        from kvcache.transfer.cuda import CudaTransferHandler  # only CUDA caches need it

        return CudaTransferHandler(self._table, geometry, owners=self._tensors)

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
    def format(self) -> KVFormat:
        return self._format

    @property
    def geometry(self) -> Geometry:
        """This cache's one geometry: what every copy job must fit (chunk shape, dtype,
        device, id bounds), and what requests are checked against."""
        return self._geometry

    @property
    def shape(self) -> Geometry:
        """The same ``geometry`` (the name from before there was one geometry type)."""
        return self._geometry

    @property
    def num_layers(self) -> int:
        return self._geometry.num_layers

    @property
    def num_blocks(self) -> int:
        return self._geometry.num_blocks

    @property
    def block_size(self) -> int:
        return self._geometry.block_size

    @property
    def num_heads(self) -> int:
        return self._geometry.num_heads

    @property
    def head_size(self) -> int:
        return self._geometry.head_size

    @property
    def kv_count(self) -> int:
        return self._geometry.kv_count

    @property
    def dtype(self) -> torch.dtype:
        return self._geometry.dtype

    @property
    def device(self) -> torch.device:
        return self._geometry.device

    @property
    def is_mla(self) -> bool:
        return LAYOUT_ROWS[self._format].kv == 1

    @property
    def chunk_size(self) -> int:
        return self._geometry.chunk_size

    @property
    def blocks_per_chunk(self) -> int:
        return self._geometry.blocks_per_chunk

    @property
    def bytes_per_token(self) -> int:
        return self._geometry.bytes_per_token

    @property
    def max_block_ids(self) -> int:
        return self._geometry.max_block_ids

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The engine tensors in layout-table order (do not resize them while registered)."""
        return list(self._tensors)

    def chunk_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int]:
        return self._geometry.chunk_shape(num_tokens)

    def chunk_nbytes(self, num_tokens: int | None = None) -> int:
        tokens = self._geometry.chunk_size if num_tokens is None else num_tokens
        return tokens * self.bytes_per_token

    def allocate_chunks(
        self,
        n: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        num_tokens: int | None = None,
    ) -> list[torch.Tensor]:
        """``n`` empty chunks; pinned host chunks let CUDA caches copy without staging."""
        target = torch.device(device)
        pin = pin_memory and target.type == "cpu" and torch.cuda.is_available()
        shape = self.chunk_shape(num_tokens)
        if target.type != "cuda" and not pin:
            return [torch.empty(shape, dtype=self._geometry.dtype, device=target) for _ in range(n)]
        with cuda_errors(f"allocating {n} chunks on {target}{' (pinned)' if pin else ''}"):
            dtype = self._geometry.dtype
            return [torch.empty(shape, dtype=dtype, device=target, pin_memory=pin) for _ in range(n)]

    # -- copies ---------------------------------------------------------------------
    @property
    def transfer(self) -> TransferHandler:
        """The handler every copy of this cache goes through (submit / poll / wait)."""
        return self._handler

    def copy_to_chunks_async(
        self,
        block_ids: BlockIds,
        chunks: Sequence[torch.Tensor],
        skip_blocks: int = 0,
        *,
        deadline: Deadline | None = None,
        after: Any = None,
    ) -> int:
        """Submit engine blocks -> chunks (store); returns the job id on ``transfer``.

        Returns before the copy ran; a bad job (ids, chunks) is reported on its result,
        and so is one not started by ``deadline`` (``TransferJob``). ``after``: a CUDA event
        the copy waits for on the device, the end of the engine's writes to the blocks
        (``TransferJob.after``; a CPU cache refuses it on the job's result).
        """
        job = TransferJob(Direction.TO_CHUNKS, block_ids, tuple(chunks), skip_blocks, deadline, after)
        return self._handler.submit(job)

    def copy_from_chunks_async(
        self,
        chunks: Sequence[torch.Tensor],
        block_ids: BlockIds,
        skip_blocks: int = 0,
        *,
        deadline: Deadline | None = None,
    ) -> int:
        """Submit chunks -> engine blocks (retrieve); returns the job id on ``transfer``.

        On a CUDA cache the engine must not read these blocks before the job finished:
        ``transfer.wait`` blocks the host, the CUDA handler's ``wait_on_stream`` only the
        engine's stream.
        """
        job = TransferJob(Direction.FROM_CHUNKS, block_ids, tuple(chunks), skip_blocks, deadline)
        return self._handler.submit(job)

    def copy_to_chunks(
        self, block_ids: BlockIds, chunks: Sequence[torch.Tensor], skip_blocks: int = 0
    ) -> None:
        """Engine blocks -> chunks (store), waited for. The first ``skip_blocks`` ids are
        not copied. Raises the job's typed error (nothing was written)."""
        self._wait_one(self.copy_to_chunks_async(block_ids, chunks, skip_blocks))

    def copy_from_chunks(
        self, chunks: Sequence[torch.Tensor], block_ids: BlockIds, skip_blocks: int = 0
    ) -> None:
        """Chunks -> engine blocks (retrieve), waited for. The first ``skip_blocks`` blocks
        are left as they are: the engine already holds them."""
        self._wait_one(self.copy_from_chunks_async(chunks, block_ids, skip_blocks))

    def synchronize(self) -> None:
        """Wait for every copy this context issued; their results stay on ``transfer``."""
        self._handler.drain()

    def close(self) -> None:
        """Finish the copies in flight and refuse new ones (idempotent)."""
        self._handler.close()

    def _wait_one(self, job_id: int) -> None:
        (result,) = self._handler.wait([job_id])
        if result.error is not None:
            raise result.error

    def __repr__(self) -> str:
        return (
            f"CacheContext(format={self._format.name}, layers={self.num_layers}, "
            f"blocks={self.num_blocks}, block_size={self.block_size}, heads={self.num_heads}, "
            f"head_size={self.head_size}, dtype={self._geometry.dtype}, device={self._geometry.device}, "
            f"chunk_size={self._geometry.chunk_size})"
        )


__all__ = ["DEFAULT_MAX_BLOCK_IDS", "CacheContext"]
