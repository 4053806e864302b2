"""The CPU handler's copies that give way: each piece asks its ``CopyPriority`` first.

While the priority says so, a piece is copied by the lowered copy (by default a native thread
in ``SCHED_IDLE``, ``transfer.lowered``), the worker waiting for it; the order promised by
``TransferHandler`` holds whichever copy runs a piece, and the priority is charged each job's
bytes at submit and credited them as it leaves; a closing handler never gives way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvcache import CacheContext, _native, reference
from kvcache.transfer import CpuTransferHandler, Direction, TransferJob
from kvcache.transfer.cpu import CopyFn, native_cpu_copy
from kvcache.transfer.lowered import LoweredCopy
from kvcache.transfer.validate import CheckedJob
from tests.transfer.helpers import make_context, page_table, poisoned_chunks


class Priority:
    """A ``CopyPriority`` that answers ``gives`` and keeps every job's bytes."""

    def __init__(self, gives: Callable[[], bool]) -> None:
        self.gives = gives
        self.charges: list[int] = []

    def charge(self, nbytes: int) -> None:
        self.charges.append(nbytes)

    def gives_way(self) -> bool:
        return self.gives()


class Recorder:
    """A copy function that records each piece it ran, then copies."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.log.append(self.name)
        native_cpu_copy(table, job, num_threads)


def _handler(
    ctx: CacheContext, priority: Priority | None, log: list[str], lowered: CopyFn | None = None
) -> CpuTransferHandler:
    return CpuTransferHandler(
        page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=Recorder("normal", log), priority=priority,
        lowered_copy=lowered if lowered is not None else Recorder("lowered", log),
    )  # fmt: skip


def _gathered(ctx: CacheContext, ids: list[int]) -> torch.Tensor:
    return reference.gather(ctx.tensors, ctx.format, ctx.shape, ids)


def _store(ids: list[int], chunks: list[torch.Tensor]) -> TransferJob:
    return TransferJob(Direction.TO_CHUNKS, ids, tuple(chunks))


def test_pieces_go_to_the_lowered_copy_while_the_priority_gives_way_and_are_reported() -> None:
    ctx = make_context()
    log: list[str] = []
    gives = [True]
    prio = Priority(lambda: gives[0])
    h = _handler(ctx, prio, log)
    chunks = [poisoned_chunks(ctx, 1) for _ in range(4)]
    ids = [h.submit(_store([4 * i + j for j in range(4)], c)) for i, c in enumerate(chunks[:2])]
    assert all(r.ok for r in h.wait(ids))
    gives[0] = False
    ids = [h.submit(_store([4 * i + j for j in range(4)], c)) for i, c in enumerate(chunks[2:], 2)]
    assert all(r.ok for r in h.wait(ids))
    assert log == ["lowered", "lowered", "normal", "normal"]
    for i, c in enumerate(chunks):
        assert torch.equal(
            c[0].view(torch.uint8), _gathered(ctx, [4 * i + j for j in range(4)]).view(torch.uint8)
        )
    block = ctx.geometry.bytes_per_block
    assert sorted(prio.charges) == [-4 * block] * 4 + [4 * block] * 4  # charged, then credited
    h.close()


def test_without_a_priority_every_piece_takes_the_normal_copy() -> None:
    ctx = make_context()
    log: list[str] = []
    h = _handler(ctx, None, log)
    (r,) = h.wait([h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))])
    assert r.ok and log == ["normal"]
    h.close()


def test_order_holds_whichever_copy_runs_each_piece() -> None:
    """The priority flips after every piece: 40 loads into the same blocks, each from its own
    chunk, then a store of those blocks; the last load wins, and the store sees it."""
    ctx = make_context()
    log: list[str] = []
    h = _handler(ctx, Priority(lambda: len(log) % 2 == 1), log)
    payloads = []
    for i in range(40):
        (c,) = ctx.allocate_chunks(1)
        c.fill_(float(i))
        payloads.append(c)
    ids = [h.submit(TransferJob(Direction.FROM_CHUNKS, [8, 9, 10, 11], (c,))) for c in payloads]
    out = poisoned_chunks(ctx, 1)
    ids.append(h.submit(_store([8, 9, 10, 11], out)))
    results = h.wait(ids)
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    assert torch.equal(_gathered(ctx, [8, 9, 10, 11]).view(torch.uint8), payloads[-1].view(torch.uint8))
    assert torch.equal(out[0].view(torch.uint8), payloads[-1].view(torch.uint8))
    assert log == ["normal", "lowered"] * 20 + ["normal"]
    h.close()


def test_a_failing_priority_counts_as_not_giving_way_and_a_malformed_job_is_charged_nothing() -> None:
    ctx = make_context()
    log: list[str] = []

    def broken() -> bool:
        raise RuntimeError("the share's accounts are gone")

    prio = Priority(broken)
    h = _handler(ctx, prio, log)
    bad = h.submit(TransferJob(Direction.TO_CHUNKS, 17, tuple(poisoned_chunks(ctx, 1))))  # type: ignore[arg-type]
    good = h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))
    bad_r, good_r = h.wait([bad, good])
    assert not bad_r.ok and good_r.ok and log == ["normal"]
    assert sum(prio.charges) == 0 and max(prio.charges) == 4 * ctx.geometry.bytes_per_block
    h.close()


def test_a_closing_handler_never_gives_way() -> None:
    """Whoever closes it (an unregister, under the daemon's registration lock) waits for its
    copies: they must not crawl at the lowest priority meanwhile."""
    ctx = make_context()
    log: list[str] = []
    gate, entered = threading.Event(), threading.Event()

    def held_open(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        entered.set()
        gate.wait()
        native_cpu_copy(table, job, num_threads)
        log.append("normal")

    h = CpuTransferHandler(
        page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=held_open,
        priority=Priority(lambda: True), lowered_copy=Recorder("lowered", log),
    )  # fmt: skip
    h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))  # lowered: the gate is not on it
    assert h.wait([0])[0].ok
    h._gives_way = lambda: False  # type: ignore[method-assign]  # the next one runs normal, held
    h.submit(_store([4, 5, 6, 7], poisoned_chunks(ctx, 1)))
    assert entered.wait(5)
    del h._gives_way  # back to the real check, asked again for the third job's piece
    h.submit(_store([8, 9, 10, 11], poisoned_chunks(ctx, 1)))
    closer = threading.Thread(target=h.close)
    closer.start()
    while not h._closed:  # close has begun: it sets the flag first, then waits for the jobs
        closer.join(0.001)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert log == ["lowered", "normal", "normal"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_the_lowered_copy_runs_on_a_native_thread_in_sched_idle_and_reports_errors_typed() -> None:
    ctx = make_context()
    lowered = LoweredCopy()
    h = CpuTransferHandler(
        page_table(ctx),
        ctx.geometry,
        owners=ctx.tensors,
        priority=Priority(lambda: True),
        lowered_copy=lowered,
    )
    chunks = poisoned_chunks(ctx, 2)
    ids = [5, 9, 2, 30, 7, 8, 1, 0]
    (r,) = h.wait([h.submit(_store(ids, chunks))])
    assert r.ok
    assert torch.equal(torch.cat(chunks, dim=2).view(torch.uint8), _gathered(ctx, ids).view(torch.uint8))
    copier = lowered.copier
    assert copier.priority == "idle"
    assert os.sched_getscheduler(copier.thread_id) == os.SCHED_IDLE
    assert copier.thread_id not in {t.native_id for t in threading.enumerate()}  # not a Python thread
    with open(f"/proc/self/task/{copier.thread_id}/comm") as f:
        assert f.read().strip() == "kvcache-lowered"  # as operators see it (top -H)
    # The native thread's failure reaches the caller typed (the handler's checks run first,
    # so the copier is called directly with an id past the cache).
    job = CheckedJob(
        block_ids=np.array([0, 1, 2, ctx.num_blocks], dtype=np.int64),
        chunk_ptrs=[chunks[0].data_ptr()],
        blocks_per_chunk=4,
        last_chunk_blocks=4,
        skip_blocks=0,
        to_chunks=True,
        blocks=4,
        nbytes=4 * ctx.geometry.bytes_per_block,
    )
    with pytest.raises(_native.BlockIdOutOfRange):
        lowered(page_table(ctx), job, 1)
    (r,) = h.wait([h.submit(_store([0, 1, 2, 3], chunks[:1]))])  # the thread lives on
    assert r.ok
    h.close()
