"""Measurement helpers shared by the transfer benchmark's synchronous and asynchronous rows.

Their own module so that ``transfer.py`` (the command, which runs both kinds of rows) and
``transfer_async.py`` (the asynchronous rows) both depend on it and not on each other: the
helpers used to live in ``transfer.py``, which made the two files import each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvcache.layouts import GPUKVFormat

MLA_FORMATS = (GPUKVFormat.NL_X_NB_BS_HS, GPUKVFormat.NL_X_NBBS_ONE_HS)
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


__all__ = ["MLA_FORMATS", "time_interleaved", "touch"]
