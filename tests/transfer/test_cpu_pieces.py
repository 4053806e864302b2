"""The CPU handler's fairness: a large job runs as pieces, and a later small job that shares
no memory with it passes it; one that does share waits for all of it. The order is read
from the copy function's calls (held by an event, never a sleep), the bytes from the cache."""

from __future__ import annotations

import threading

import torch

from kvcache import CacheContext, _native
from kvcache.transfer import CpuTransferHandler, Direction, TransferJob
from kvcache.transfer.cpu import native_cpu_copy
from kvcache.transfer.validate import CheckedJob
from tests.transfer.helpers import make_context, page_table, poisoned_chunks
from tests.transfer.test_cpu import _gathered

BPC = 4  # blocks per chunk in make_context


class HoldFirst:
    """Records each piece (its first chunk's address) and holds the first until ``opened``."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.calls.append(job.chunk_ptrs[0])
        if len(self.calls) == 1:
            self.entered.set()
            assert self.opened.wait(30), "the test never opened the gate"
        native_cpu_copy(table, job, num_threads)


def _handler(copy: HoldFirst) -> tuple[CpuTransferHandler, CacheContext]:
    ctx = make_context()
    piece = BPC * ctx.geometry.bytes_per_block  # one chunk per piece
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=copy, piece_bytes=piece)
    return h, ctx


def test_a_small_job_passes_a_large_one_cut_into_pieces() -> None:
    copy = HoldFirst()
    h, ctx = _handler(copy)
    big_chunks, small_chunks = poisoned_chunks(ctx, 4), poisoned_chunks(ctx, 1)
    big_ids, small_ids = list(range(16)), [20, 21, 22, 23]
    big = h.submit(TransferJob(Direction.TO_CHUNKS, big_ids, tuple(big_chunks)))
    assert copy.entered.wait(10)  # the large job's first piece is running
    small = h.submit(TransferJob(Direction.TO_CHUNKS, small_ids, tuple(small_chunks)))
    copy.opened.set()
    results = {r.job_id: r for r in h.wait([big, small])}
    ptrs = [c.data_ptr() for c in big_chunks]
    assert copy.calls == [ptrs[0], small_chunks[0].data_ptr(), *ptrs[1:]]  # one piece, then the small job
    assert results[big].ok and results[big].blocks == 16 and results[small].blocks == 4
    assert results[big].bytes == 16 * ctx.geometry.bytes_per_block
    got = torch.cat(big_chunks, dim=2).view(torch.uint8)
    assert torch.equal(got, _gathered(ctx, big_ids).view(torch.uint8))
    assert torch.equal(small_chunks[0].view(torch.uint8), _gathered(ctx, small_ids).view(torch.uint8))
    h.close()


def test_a_job_sharing_a_block_waits_for_all_of_the_earlier_one() -> None:
    """A load into a block that an earlier store still reads must not pass it: the store's
    chunks hold the block's bytes from before the load."""
    copy = HoldFirst()
    h, ctx = _handler(copy)
    big_chunks = poisoned_chunks(ctx, 4)
    big_ids = list(range(16))
    want = _gathered(ctx, big_ids).clone()
    (payload,) = ctx.allocate_chunks(1)
    payload.fill_(3.0)
    big = h.submit(TransferJob(Direction.TO_CHUNKS, big_ids, tuple(big_chunks)))
    assert copy.entered.wait(10)
    load = h.submit(TransferJob(Direction.FROM_CHUNKS, [12, 24, 25, 26], (payload,)))  # block 12 shared
    copy.opened.set()
    assert all(r.ok for r in h.wait([big, load]))
    assert copy.calls == [c.data_ptr() for c in big_chunks] + [payload.data_ptr()]
    assert torch.equal(torch.cat(big_chunks, dim=2).view(torch.uint8), want.view(torch.uint8))
    h.close()


def test_wait_any_returns_the_first_finished_and_interrupt_wakes_it() -> None:
    copy = HoldFirst()
    h, ctx = _handler(copy)
    chunks = tuple(poisoned_chunks(ctx, 4))
    big = h.submit(TransferJob(Direction.TO_CHUNKS, list(range(16)), chunks))
    assert copy.entered.wait(10)
    woke: list[list[int]] = []
    waiter = threading.Thread(target=lambda: woke.append([r.job_id for r in h.wait_any([big])]))
    waiter.start()
    h.interrupt()  # may come before the waiter waits: it then waits for the job itself
    copy.opened.set()
    waiter.join(30)
    assert woke and woke[0] in ([], [big])
    rest = h.wait([big]) if woke[0] == [] else []
    assert all(r.ok for r in rest)
    h.close()


def test_a_job_waits_on_the_latest_job_touching_its_memory_not_on_every_earlier_one() -> None:
    """Each queued job used to list, as its blockers, every earlier queued job it overlapped,
    found by comparing it with each of them (a ``numpy.isin`` per pair): thousands of stores
    of one engine into the same blocks (a store flood) cost the worker O(n^2) under the GIL,
    every other tenant's time. The latest job touching a block or chunk is enough: it waits in
    turn for the one before it, so the order is the same, and the last write still wins."""
    seen: list[int] = []
    gate = threading.Event()
    handler: list[CpuTransferHandler] = []

    def copy(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        if not seen:
            assert gate.wait(30), "the test never opened the gate"
        seen.append(max(len(q.blockers) for q in handler[0]._queue))
        native_cpu_copy(table, job, num_threads)

    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=copy)
    handler.append(h)
    payloads = []
    for i in range(50):  # 50 loads into the same four blocks, each from its own chunk
        (c,) = ctx.allocate_chunks(1)
        c.fill_(float(i))
        payloads.append(c)
    ids = [h.submit(TransferJob(Direction.FROM_CHUNKS, [8, 9, 10, 11], (c,))) for c in payloads]
    gate.set()
    results = h.wait(ids)
    assert all(r.ok for r in results)
    assert max(seen) <= 1, f"a job waited on {max(seen)} earlier jobs"
    assert torch.equal(_gathered(ctx, [8, 9, 10, 11]).view(torch.uint8), payloads[-1].view(torch.uint8))
    h.close()
