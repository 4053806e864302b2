# Type stub for the pybind11 module built from csrc/bindings_pybind.cpp.
from collections.abc import Sequence
from typing import Any

import numpy as np

class CudaUnavailable(RuntimeError): ...

class BlockIdOutOfRange(IndexError):
    position: int
    block_id: int

def layout_table() -> list[dict[str, Any]]: ...
def page_placements(fmt: int, num_layers: int, num_blocks: int) -> tuple[list[tuple[int, int]], int]: ...
def expected_num_tensors(fmt: int, num_layers: int) -> int: ...

class PageTable:
    fmt: int
    num_layers: int
    kv: int
    num_blocks: int
    page_bytes: int
    block_stride_bytes: int
    base: list[int]
    def __init__(
        self,
        fmt: int,
        num_layers: int,
        num_blocks: int,
        page_bytes: int,
        tensor_ptrs: list[int],
        tensor_bytes: list[int],
    ) -> None: ...

class LoweredCopier:
    """``cpu_copy`` on a native thread of its own in the lowest CPU class (csrc/kvc_lowered.h)."""

    priority: str
    thread_id: int
    def __init__(self) -> None: ...
    def copy(
        self,
        table: PageTable,
        block_ids: np.ndarray,
        chunk_ptrs: list[int],
        blocks_per_chunk: int,
        last_chunk_blocks: int,
        skip_blocks: int,
        to_chunks: bool,
        num_threads: int = 0,
    ) -> None: ...

def validate(
    table: PageTable,
    block_ids: np.ndarray,
    chunk_ptrs: list[int],
    blocks_per_chunk: int,
    last_chunk_blocks: int,
    skip_blocks: int,
) -> None: ...
def cpu_copy(
    table: PageTable,
    block_ids: np.ndarray,
    chunk_ptrs: list[int],
    blocks_per_chunk: int,
    last_chunk_blocks: int,
    skip_blocks: int,
    to_chunks: bool,
    num_threads: int = 0,
) -> None: ...
def emulate_kernel(
    table: PageTable,
    block_ids: np.ndarray,
    chunk_ptrs: list[int],
    blocks_per_chunk: int,
    last_chunk_blocks: int,
    skip_blocks: int,
    to_chunks: bool,
) -> int: ...
def parallel_memcpy(dst: int, src: int, nbytes: int, num_threads: int = 0) -> None: ...
def copy_unit_bytes(table: PageTable, chunks: list[int]) -> int: ...
def chain_keys_u32(
    root: bytes, person: bytes, chunk_tokens: int, prompts: Sequence[bytes | memoryview]
) -> tuple[list[list[int]], list[int]]: ...
def blake2b_16(person: bytes, data: bytes) -> bytes: ...
def cuda_compiled() -> bool: ...
def cuda_device_count() -> int: ...

class CudaTransfer:
    max_block_ids: int
    last_copy_unit: int
    def __init__(self, table: PageTable, device: int, max_block_ids: int, max_chunks: int) -> None: ...
    def copy(
        self,
        block_ids: np.ndarray,
        chunk_ptrs: list[int],
        blocks_per_chunk: int,
        last_chunk_blocks: int,
        skip_blocks: int,
        to_chunks: bool,
        stream: int,
    ) -> None: ...
