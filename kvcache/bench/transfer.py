"""Transfer benchmark: block-id copies for every layout against the physical ceiling.

In one run, for each layout, it times the native copy in both directions and, on the
same bytes and threads, the ceiling (CPU: one parallel memcpy of a contiguous buffer;
GPU: pinned ``cudaMemcpyAsync`` for host chunks and device-to-device memcpy for device
chunks) and the "what a user would write" baseline (``torch.index_select`` per layer).
Reports GB/s and the ratio to the ceiling; never asserts a speed. On a GPU the kernel and
its ceiling are timed on the device (CUDA events), and the synchronous call as the host
sees it (submit, launch and wait) is reported beside them as ``call``.

It then times the asynchronous face (``copy_*_async``): how long a submit takes to return
against the copy itself, and a batch of back-to-back submits against the same copies made
synchronously, side by side in the same run. ``--dtypes`` repeats the layout rows per
element type (``bf16,fp8`` on a GPU: the kernels move bytes, so fp8 halves each transfer).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvcache import _native
from kvcache.bench.transfer_async import AsyncRow, bench_async, print_async
from kvcache.bench.transfer_timing import (
    MLA_FORMATS,
    event_seconds,
    time_device_interleaved,
    time_interleaved,
    touch,
)
from kvcache.context import CacheContext
from kvcache.layouts import KVFormat
from kvcache.reference import page_view
from kvcache.testing import ENGINE_OF, make_kv_caches


@dataclass(frozen=True)
class Row:
    """One measurement: a layout, where its chunks live, one direction."""

    layout: str
    dtype: str
    chunks_in: str
    direction: str
    bytes: int
    kernel_gbps: float
    ceiling_gbps: float
    ratio_to_ceiling: float
    index_select_gbps: float | None
    call_gbps: float  # the synchronous call by the host's clock (the kernel figure on a CPU)
    call_ratio: float  # ... against the ceiling's call by the host's clock


def _index_select_baseline(
    ctx: CacheContext, caches: object, ids: torch.Tensor, out: torch.Tensor
) -> Callable[[], None]:
    """Per (layer, kv): index_select the blocks, then copy into the chunk buffer."""
    views = [
        (kv, layer, page_view(caches, ctx.format, ctx.shape, layer, kv))  # type: ignore[arg-type]
        for kv in range(ctx.kv_count)
        for layer in range(ctx.num_layers)
    ]

    def run() -> None:
        for kv, layer, view in views:
            out[kv, layer].copy_(view.index_select(0, ids).flatten(0, 1), non_blocking=True)

    return run


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
"""``--dtypes`` names: the element types an engine's KV cache comes in."""


def bench_layout(fmt: KVFormat, args: argparse.Namespace, device: str, dtype: str) -> list[Row]:
    rng = np.random.default_rng(args.seed)
    caches = make_kv_caches(
        fmt,
        num_layers=args.layers,
        num_blocks=args.blocks,
        block_size=args.block_size,
        num_heads=args.heads,
        head_size=args.mla_head_size if fmt in MLA_FORMATS else args.head_size,
        dtype=DTYPES[dtype],
        device=device,
        fill=False,
    )
    touch(caches)  # fault every page in: untouched memory reads as the shared zero page
    ctx = CacheContext(
        caches,
        chunk_size=args.chunk_size,
        fmt=fmt,
        engine=ENGINE_OF[fmt],
        block_size=args.block_size,
        num_threads=args.threads,
    )
    n_blocks = args.chunks * ctx.blocks_per_chunk
    ids_np = rng.choice(args.blocks, size=n_blocks, replace=False).astype(np.int64)
    rows: list[Row] = []
    if device == "cpu":
        places = [("cpu", "cpu", False)]
        sync: Callable[[], None] = lambda: None  # noqa: E731
    else:
        places = [("pinned-host", "cpu", True), ("device", device, False)]
        sync = torch.cuda.synchronize
    for place, chunk_device, pin in places:
        rows.extend(_bench_place(ctx, caches, ids_np, args, device, place, chunk_device, pin, sync))
    ctx.close()
    return rows


def _bench_place(
    ctx: CacheContext,
    caches: object,
    ids_np: np.ndarray,
    args: argparse.Namespace,
    device: str,
    place: str,
    chunk_device: str,
    pin: bool,
    sync: Callable[[], None],
) -> list[Row]:
    """Kernel, ceiling and index_select baseline for chunks living in one place."""
    n_blocks = len(ids_np)
    nbytes = ctx.chunk_nbytes(args.chunk_size) * args.chunks
    chunks = ctx.allocate_chunks(args.chunks, device=chunk_device, pin_memory=pin)
    big = torch.empty(nbytes, dtype=torch.uint8, device=chunk_device, pin_memory=pin)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for c in chunks:
        c.view(torch.uint8).fill_(1)
    if device == "cpu":
        src.fill_(1)
        big.fill_(1)

        def ceiling_store() -> None:
            _native.parallel_memcpy(big.data_ptr(), src.data_ptr(), nbytes, args.threads)

        ceiling_load = ceiling_store
    else:

        def ceiling_store() -> None:
            big.copy_(src, non_blocking=True)

        def ceiling_load() -> None:
            src.copy_(big, non_blocking=True)

    out = torch.empty(
        (ctx.kv_count, ctx.num_layers, n_blocks * ctx.block_size, ctx.num_heads * ctx.head_size),
        dtype=ctx.dtype,
        device=chunk_device,
        pin_memory=pin,
    )
    fns = [
        lambda: ctx.copy_to_chunks(ids_np, chunks),
        ceiling_store,
        lambda: ctx.copy_from_chunks(chunks, ids_np),
        ceiling_load,
    ]
    baseline = _index_select_baseline(ctx, caches, torch.as_tensor(ids_np, device=device), out)
    try:  # torch has no index_select for some dtypes on some devices (fp8 on CUDA)
        baseline()
        sync()
        fns.append(baseline)
    except (RuntimeError, NotImplementedError):
        pass
    times = time_interleaved(fns, args.reps, sync)
    base_gbps = nbytes / times[4] / 1e9 if len(times) > 4 else None
    device_times = times[:4]  # a CPU's wall clock is its device time
    if device != "cpu":
        handler = ctx.transfer

        def job_seconds(job_id: int) -> float:
            (result,) = handler.wait([job_id])
            if result.error is not None:
                raise result.error
            return result.seconds

        device_times = time_device_interleaved(
            [
                lambda: job_seconds(ctx.copy_to_chunks_async(ids_np, chunks)),
                lambda: event_seconds(ceiling_store),
                lambda: job_seconds(ctx.copy_from_chunks_async(chunks, ids_np)),
                lambda: event_seconds(ceiling_load),
            ],
            args.reps,
        )
    rows = []
    for direction, (kernel, ceiling), (call, call_ceiling) in (
        ("store", device_times[0:2], times[0:2]),
        ("load", device_times[2:4], times[2:4]),
    ):
        rows.append(
            Row(
                ctx.format.name,
                str(ctx.dtype).removeprefix("torch."),
                place,
                direction,
                nbytes,
                nbytes / kernel / 1e9,
                nbytes / ceiling / 1e9,
                ceiling / kernel,
                base_gbps if direction == "store" else None,
                nbytes / call / 1e9,
                call_ceiling / call,
            )
        )
    return rows


def _print_table(rows: list[Row]) -> None:
    head = (
        f"{'layout':<24} {'dtype':<14} {'chunks':<12} {'dir':<6} {'MiB':>7} {'GB/s':>7} {'ceil GB/s':>9} "
        f"{'ratio':>6} {'idx_sel':>7} {'call GB/s':>9} {'call ratio':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        base = "" if r.index_select_gbps is None else f"{r.index_select_gbps:.2f}"
        print(
            f"{r.layout:<24} {r.dtype:<14} {r.chunks_in:<12} {r.direction:<6} {r.bytes / 2**20:>7.0f} "
            f"{r.kernel_gbps:>7.2f} {r.ceiling_gbps:>9.2f} {r.ratio_to_ceiling:>6.2f} {base:>7} "
            f"{r.call_gbps:>9.2f} {r.call_ratio:>10.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench transfer", description=__doc__)
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when usable)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--mla-head-size", type=int, default=576, help="latent width for MLA layouts")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--blocks", type=int, default=1024, help="blocks in the engine cache")
    p.add_argument("--chunks", type=int, default=8, help="chunks per copy")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="all", help="comma-separated KVFormat names")
    p.add_argument("--async-layout", default="NL_X_TWO_NB_BS_NH_HS", help="layout of the async rows")
    p.add_argument("--async-batch", type=int, default=8, help="back-to-back copies per async batch")
    p.add_argument("--dtypes", default="bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--no-async", action="store_true", help="skip the async rows")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.blocks, args.chunks, args.reps = 8, 512, 8, 3
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and _native.cuda_compiled() else "cpu"
    fmts = list(KVFormat) if args.layouts == "all" else [KVFormat[n] for n in args.layouts.split(",")]
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown --dtypes {unknown}; choose from {list(DTYPES)}")
    rows: list[Row] = []
    for dtype in dtypes:
        for fmt in fmts:
            rows.extend(bench_layout(fmt, args, device, dtype))
    async_rows: list[AsyncRow] = [] if args.no_async else bench_async(args, device)
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "cpu_threads": args.threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(
        f"transfer benchmark on {device} ({env['device']}), {args.dtypes}, {args.layers} layers, "
        f"{args.heads}x{args.head_size} heads, block {args.block_size}, chunk {args.chunk_size}"
    )
    _print_table(rows)
    if async_rows:
        print()
        print_async(async_rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "env": env,
            "results": [asdict(r) for r in rows],
            "async": [asdict(r) for r in async_rows],
        }
        args.out.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
