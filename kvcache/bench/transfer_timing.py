"""Measurement helpers shared by the transfer benchmark's synchronous and asynchronous rows.

Their own module so that ``transfer.py`` (the command, which runs both kinds of rows) and
``transfer_async.py`` (the asynchronous rows) both depend on it and not on each other: the
helpers used to live in ``transfer.py``, which made the two files import each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvcache.layouts import KVFormat

MLA_FORMATS = (KVFormat.NL_X_NB_BS_HS, KVFormat.NL_X_NBBS_ONE_HS)
"""Layouts whose one head is the MLA latent: they take ``--mla-head-size`` as head width."""


def touch(caches: object) -> None:
    """Write every byte once, so no timed run pays first-touch page faults.

    Untouched memory reads as the shared zero page, which would flatter the first copies.
    """
    if isinstance(caches, torch.Tensor):
        caches.view(torch.uint8).fill_(1)
        return
    for part in caches:  # type: ignore[attr-defined]
        touch(part)


def time_interleaved(fns: list[Callable[[], None]], reps: int, sync: Callable[[], None]) -> list[float]:
    """Best-of-``reps`` seconds for each function, measured round-robin.

    Interleaving puts the kernel and its ceiling under the same background load and the
    same thermal/frequency state, so their ratio stays meaningful on a busy machine;
    the minimum is the least-disturbed run of each.
    """
    for fn in fns:  # warm-up: page faults, lazy allocations, JIT of the first launch
        fn()
    sync()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_device_interleaved(fns: list[Callable[[], float]], reps: int) -> list[float]:
    """Best-of-``reps`` device seconds for each function, measured round-robin.

    Each function runs one copy and returns its own device time, read from CUDA events
    recorded on the stream around it. On a GPU the host's share of a call (Python checks,
    the launch) would otherwise sit inside the figure: a 256 MiB device-to-device copy takes
    about 0.15 ms, the same order as a submit, so wall-clock ratios there measure the host.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], fn())
    return best


def event_seconds(copy: Callable[[], None]) -> float:
    """Device seconds of ``copy`` on the current CUDA stream, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    copy()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


__all__ = ["MLA_FORMATS", "event_seconds", "time_device_interleaved", "time_interleaved", "touch"]
