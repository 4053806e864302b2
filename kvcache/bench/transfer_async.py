"""Transfer benchmark, asynchronous rows: submit latency and back-to-back throughput.

Separate from ``transfer.py`` (which it extends, under the same command) because it
measures the ``copy_*_async`` face of the context, not the copy kernels: how long a
submit takes to return against the copy itself (target < 1 %), and ``--async-batch``
copies submitted back to back against the same copies made synchronously (target
>= 0.95x), side by side in the same run. On a GPU the chunks are in pinned host memory
(the L1 of a real deployment) and the copy time is the job's own CUDA-event time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.bench.transfer_timing import MLA_FORMATS, time_interleaved, touch
from kvcache.context import CacheContext
from kvcache.layouts import KVFormat
from kvcache.testing import ENGINE_OF, make_kv_caches


@dataclass(frozen=True)
class AsyncRow:
    """Asynchronous submission against the synchronous copy, measured side by side."""

    layout: str
    direction: str
    bytes: int
    submit_us_median: float  # time for submit to return
    copy_ms_median: float  # the same job's own copy time (its TransferResult.seconds)
    submit_fraction: float  # median over reps of submit time / copy time (target < 0.01)
    batch: int
    sync_loop_gbps: float  # ``batch`` synchronous copies one after another
    async_batch_gbps: float  # ``batch`` submits, then one wait for all of them
    async_to_sync: float  # async_batch_gbps / sync_loop_gbps (target >= 0.95)


def bench_async(args: argparse.Namespace, device: str = "cpu") -> list[AsyncRow]:
    """Submit latency and back-to-back throughput of ``copy_*_async`` on ``device``.

    One layout, ``--chunks`` chunks per copy (8 x 256 tokens: 256 MiB at the defaults).
    The latency is read per job: how long ``submit`` took to return against the job's own
    copy seconds. Throughput: ``--async-batch`` copies submitted back to back and waited
    for once, against the same copies issued synchronously, interleaved best-of-reps.
    """
    fmt = KVFormat[args.async_layout]
    caches = make_kv_caches(
        fmt,
        num_layers=args.layers,
        num_blocks=args.blocks,
        block_size=args.block_size,
        num_heads=args.heads,
        head_size=args.mla_head_size if fmt in MLA_FORMATS else args.head_size,
        dtype=torch.bfloat16,
        device=device,
        fill=False,
    )
    touch(caches)
    ctx = CacheContext(
        caches, args.chunk_size, fmt, ENGINE_OF[fmt], args.block_size, num_threads=args.threads
    )
    rng = np.random.default_rng(args.seed)
    n_blocks = args.chunks * ctx.blocks_per_chunk
    id_sets = [
        rng.choice(args.blocks, size=n_blocks, replace=False).astype(np.int64)
        for _ in range(args.async_batch)
    ]
    chunks = ctx.allocate_chunks(args.chunks, pin_memory=device != "cpu")
    for c in chunks:
        c.view(torch.uint8).fill_(1)
    rows = [
        _async_row(
            ctx,
            args,
            "store",
            lambda ids: ctx.copy_to_chunks_async(ids, chunks),
            lambda ids: ctx.copy_to_chunks(ids, chunks),
            id_sets,
        ),
        _async_row(
            ctx,
            args,
            "load",
            lambda ids: ctx.copy_from_chunks_async(chunks, ids),
            lambda ids: ctx.copy_from_chunks(chunks, ids),
            id_sets,
        ),
    ]
    ctx.close()
    return rows


def _async_row(
    ctx: CacheContext,
    args: argparse.Namespace,
    direction: str,
    submit: Callable[[np.ndarray], int],
    copy: Callable[[np.ndarray], None],
    id_sets: list[np.ndarray],
) -> AsyncRow:
    handler = ctx.transfer
    handler.wait([submit(id_sets[0])])  # warm-up: the worker thread, page faults
    submit_s, copy_s = [], []
    for rep in range(args.reps * 3):
        ids = id_sets[rep % len(id_sets)]
        start = time.perf_counter()
        job = submit(ids)
        submit_s.append(time.perf_counter() - start)
        (result,) = handler.wait([job])
        copy_s.append(result.seconds)
    fractions = [a / b for a, b in zip(submit_s, copy_s, strict=True)]

    def sync_loop() -> None:
        for ids in id_sets:
            copy(ids)

    def async_batch() -> None:
        handler.wait([submit(ids) for ids in id_sets])

    t_sync, t_async = time_interleaved([sync_loop, async_batch], args.reps, lambda: None)
    total = ctx.chunk_nbytes() * args.chunks * len(id_sets)
    return AsyncRow(
        ctx.format.name,
        direction,
        ctx.chunk_nbytes() * args.chunks,
        float(np.median(submit_s)) * 1e6,
        float(np.median(copy_s)) * 1e3,
        float(np.median(fractions)),
        len(id_sets),
        total / t_sync / 1e9,
        total / t_async / 1e9,
        t_sync / t_async,
    )


def print_async(rows: list[AsyncRow]) -> None:
    head = (
        f"{'async':<24} {'dir':<6} {'MiB':>5} {'submit us':>9} {'copy ms':>8} {'submit/copy':>11} "
        f"{'sync GB/s':>9} {'async GB/s':>10} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.layout:<24} {r.direction:<6} {r.bytes / 2**20:>5.0f} {r.submit_us_median:>9.1f} "
            f"{r.copy_ms_median:>8.2f} {r.submit_fraction:>10.2%} {r.sync_loop_gbps:>9.2f} "
            f"{r.async_batch_gbps:>10.2f} {r.async_to_sync:>6.2f}"
        )


__all__ = ["AsyncRow", "bench_async", "print_async"]
