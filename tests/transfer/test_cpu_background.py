"""The CPU handler's copies that give way: run at the lowest CPU priority while asked to.

``background`` is asked before each piece; while it says True the piece runs on the second
worker, lowered to ``SCHED_IDLE``, else on the first, at the thread's normal priority. The
order promised by ``TransferHandler`` must hold across every hand-over.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvcache import CacheContext, _native, reference
from kvcache.transfer import CpuTransferHandler, Direction, TransferJob
from kvcache.transfer.cpu import native_cpu_copy
from kvcache.transfer.validate import CheckedJob
from tests.transfer.helpers import make_context, page_table, poisoned_chunks

needs_sched_idle = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")


class Recorder:
    """A copy function that records, per piece, the worker's name and scheduling class."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, int]] = []

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.pieces.append((threading.current_thread().name, os.sched_getscheduler(0)))
        native_cpu_copy(table, job, num_threads)


def _handler(
    ctx: CacheContext, copy: Recorder, background: object, idle_exit_s: float = 2.0
) -> CpuTransferHandler:
    return CpuTransferHandler(
        page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=copy, background=background,  # type: ignore[arg-type]
        idle_exit_s=idle_exit_s,
    )  # fmt: skip


def _gathered(ctx: CacheContext, ids: list[int]) -> torch.Tensor:
    return reference.gather(ctx.tensors, ctx.format, ctx.shape, ids)


@needs_sched_idle
def test_copies_that_give_way_run_on_a_worker_at_the_lowest_priority() -> None:
    ctx = make_context()
    rec = Recorder()
    h = _handler(ctx, rec, lambda: True)
    chunks = [poisoned_chunks(ctx, 1) for _ in range(4)]
    ids = [
        h.submit(TransferJob(Direction.TO_CHUNKS, [4 * i + j for j in range(4)], tuple(c)))
        for i, c in enumerate(chunks)
    ]
    assert all(r.ok for r in h.wait(ids))
    assert rec.pieces == [("kvcache-transfer-cpu-bg", os.SCHED_IDLE)] * 4
    for i, c in enumerate(chunks):
        assert torch.equal(
            c[0].view(torch.uint8), _gathered(ctx, [4 * i + j for j in range(4)]).view(torch.uint8)
        )
    h.close()


@needs_sched_idle
def test_copies_that_do_not_give_way_run_at_normal_priority_and_without_a_predicate_on_one_worker() -> None:
    ctx = make_context()
    for background in (lambda: False, None):
        rec = Recorder()
        h = _handler(ctx, rec, background)
        ids = [
            h.submit(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(poisoned_chunks(ctx, 1))))
            for _ in range(3)
        ]
        assert all(r.ok for r in h.wait(ids))
        assert rec.pieces == [("kvcache-transfer-cpu", os.sched_getscheduler(0))] * 3
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
        assert set(h._workers) == ({False} if background is None else {False, True})
        h.close()


def test_order_holds_across_every_hand_over() -> None:
    """A predicate that flips after every piece: 40 loads into the same blocks, each from its
    own chunk, then a store of those blocks; the last load wins, and the store sees it."""
    ctx = make_context()
    rec = Recorder()
    h = _handler(ctx, rec, lambda: len(rec.pieces) % 2 == 1)
    payloads = []
    for i in range(40):
        (c,) = ctx.allocate_chunks(1)
        c.fill_(float(i))
        payloads.append(c)
    ids = [h.submit(TransferJob(Direction.FROM_CHUNKS, [8, 9, 10, 11], (c,))) for c in payloads]
    out = poisoned_chunks(ctx, 1)
    ids.append(h.submit(TransferJob(Direction.TO_CHUNKS, [8, 9, 10, 11], tuple(out))))
    results = h.wait(ids)
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    assert torch.equal(_gathered(ctx, [8, 9, 10, 11]).view(torch.uint8), payloads[-1].view(torch.uint8))
    assert torch.equal(out[0].view(torch.uint8), payloads[-1].view(torch.uint8))
    names = [name for name, _ in rec.pieces]
    assert names == ["kvcache-transfer-cpu", "kvcache-transfer-cpu-bg"] * 20 + ["kvcache-transfer-cpu"]
    h.close()


def test_a_failing_predicate_counts_as_not_giving_way() -> None:
    ctx = make_context()
    rec = Recorder()

    def broken() -> bool:
        raise RuntimeError("the share's accounts are gone")

    h = _handler(ctx, rec, broken)
    (r,) = h.wait([h.submit(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(poisoned_chunks(ctx, 1))))])
    assert r.ok and rec.pieces[0][0] == "kvcache-transfer-cpu"
    h.close()


def test_both_workers_leave_when_idle_and_close_waits_for_them() -> None:
    ctx = make_context()
    rec = Recorder()
    h = _handler(ctx, rec, lambda: True, idle_exit_s=0.0)
    for i in range(5):  # each submit after the workers left starts both again
        (r,) = h.wait(
            [
                h.submit(
                    TransferJob(Direction.TO_CHUNKS, [i, i + 1, i + 2, i + 3], tuple(poisoned_chunks(ctx, 1)))
                )
            ]
        )
        assert r.ok
    h.close()
    assert not h._workers  # close returned only once both had gone
