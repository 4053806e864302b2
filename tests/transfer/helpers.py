"""Shared pieces of the transfer tests: a small registered cache and a gate that holds a
job in flight until the test opens it (an event, never a sleep)."""

from __future__ import annotations

import threading

import torch

from kvcache import CacheContext, _native
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches
from kvcache.transfer.cpu import CpuTransferHandler, native_cpu_copy
from kvcache.transfer.validate import CheckedJob

NB, BS, CHUNK = 32, 16, 64  # 4 blocks per chunk
POISON = 0xA5
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


def make_context(device: str = "cpu", seed: int = 0) -> CacheContext:
    caches = make_kv_caches(
        FMT, num_layers=2, num_blocks=NB, block_size=BS, num_heads=2, head_size=32, device=device, seed=seed
    )
    return CacheContext(caches, chunk_size=CHUNK, fmt=FMT, block_size=BS)


def page_table(ctx: CacheContext) -> _native.PageTable:
    """A second native page table over the same engine memory as ``ctx``."""
    return _native.PageTable(
        int(ctx.format),
        ctx.num_layers,
        ctx.num_blocks,
        ctx.shape.page_bytes,
        [t.data_ptr() for t in ctx.tensors],
        [t.numel() * t.element_size() for t in ctx.tensors],
    )


class Gate:
    """A copy function that signals when a job started and runs it once the gate opens."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.entered.set()
        self.opened.wait()
        native_cpu_copy(table, job, num_threads)


def gated_handler(ctx: CacheContext, gate: Gate, idle_exit_s: float = 2.0) -> CpuTransferHandler:
    return CpuTransferHandler(
        page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=gate, idle_exit_s=idle_exit_s
    )


def poisoned_chunks(ctx: CacheContext, n: int, device: str = "cpu", pin: bool = False) -> list[torch.Tensor]:
    chunks = ctx.allocate_chunks(n, device=device, pin_memory=pin)
    for c in chunks:
        c.view(torch.uint8).fill_(POISON)
    return chunks


def snapshot(ctx: CacheContext) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in ctx.tensors]


def unchanged(ctx: CacheContext, before: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(ctx.tensors, before, strict=True)
    )
