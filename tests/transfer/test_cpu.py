"""The asynchronous contract on the CPU handler: ordering, jobs in flight, bounded waits,
errors on results with nothing written, and shutdown with jobs in flight."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvcache import CacheContext, _native, reference
from kvcache.deadline import Deadline
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    CudaUnavailableError,
    DeadlineExceededError,
    TransferError,
    UnknownTransferError,
)
from kvcache.transfer import CpuTransferHandler, Direction, TransferJob
from kvcache.transfer.cpu import native_cpu_copy
from kvcache.transfer.validate import CheckedJob
from tests.transfer.helpers import (
    NB,
    POISON,
    Gate,
    gated_handler,
    make_context,
    page_table,
    poisoned_chunks,
    snapshot,
    unchanged,
)


def _store(ids: list[int], chunks: list[torch.Tensor], skip: int = 0) -> TransferJob:
    return TransferJob(Direction.TO_CHUNKS, ids, tuple(chunks), skip)


def _load(chunks: list[torch.Tensor], ids: list[int], skip: int = 0) -> TransferJob:
    return TransferJob(Direction.FROM_CHUNKS, ids, tuple(chunks), skip)


def _gathered(ctx: CacheContext, ids: list[int]) -> torch.Tensor:
    return reference.gather(ctx.tensors, ctx.format, ctx.shape, ids)


def test_submit_returns_before_the_copy_runs_and_results_carry_the_figures() -> None:
    ctx = make_context()
    gate = Gate()
    h = gated_handler(ctx, gate)
    chunks = poisoned_chunks(ctx, 2)
    ids = [5, 9, 2, 30, 7, 8, 1, 0]
    job_id = h.submit(_store(ids, chunks, skip=1))  # the copy is held at the gate
    assert gate.entered.wait(5)
    assert h.get_finished() == []  # non-blocking: nothing finished yet
    gate.opened.set()
    (result,) = h.wait([job_id])
    assert result.ok and result.error is None
    assert result.job_id == job_id and result.direction is Direction.TO_CHUNKS
    assert result.blocks == 7
    assert result.bytes == 7 * ctx.block_size * ctx.bytes_per_token
    assert result.seconds > 0
    got = torch.cat(chunks, dim=2)
    assert torch.equal(got[:, :, 16:].view(torch.uint8), _gathered(ctx, ids)[:, :, 16:].view(torch.uint8))
    h.close()


def test_jobs_take_effect_in_submission_order() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    src_ids, dst_ids = [3, 4, 5, 6], [20, 21, 22, 23]
    want = _gathered(ctx, src_ids).clone()
    chunk = poisoned_chunks(ctx, 1)
    # store then load of the same chunk, submitted without waiting in between
    a = h.submit(_store(src_ids, chunk))
    b = h.submit(_load(chunk, dst_ids))
    results = h.wait([a, b])
    assert [r.job_id for r in results] == [a, b] and all(r.ok for r in results)
    assert torch.equal(_gathered(ctx, dst_ids).view(torch.uint8), want.view(torch.uint8))
    h.close()


def test_many_jobs_in_flight_finish_in_order_and_the_last_write_wins() -> None:
    ctx = make_context()
    gate = Gate()
    h = gated_handler(ctx, gate)
    payloads = []
    for i in range(40):  # 40 loads into the same four blocks, each from its own chunk
        (c,) = ctx.allocate_chunks(1)
        c.fill_(float(i))
        payloads.append(c)
    ids = [h.submit(_load([c], [8, 9, 10, 11])) for c in payloads]
    assert gate.entered.wait(5)
    assert h.get_finished() == []
    gate.opened.set()
    results = h.wait(ids)
    assert [r.job_id for r in results] == ids == sorted(ids)
    assert all(r.ok for r in results)
    assert torch.equal(_gathered(ctx, [8, 9, 10, 11]).view(torch.uint8), payloads[-1].view(torch.uint8))
    assert h.get_finished() == []  # each result is handed out once
    h.close()


def test_get_finished_reports_in_submission_order() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    chunks = [poisoned_chunks(ctx, 1) for _ in range(6)]
    ids = [h.submit(_store([i, i + 1, i + 2, i + 3], c)) for i, c in enumerate(chunks)]
    h.drain()
    assert [r.job_id for r in h.get_finished()] == ids
    h.close()


def test_wait_with_timeout_leaves_an_unfinished_job_pending() -> None:
    ctx = make_context()
    gate = Gate()
    h = gated_handler(ctx, gate)
    chunks = poisoned_chunks(ctx, 1)
    first = h.submit(_store([0, 1, 2, 3], chunks))
    second = h.submit(_store([4, 5, 6, 7], poisoned_chunks(ctx, 1)))
    assert gate.entered.wait(5)
    assert h.wait([first, second], timeout=0.02) == []  # neither can finish while gated
    assert h.wait([first], timeout=0) == []
    gate.opened.set()
    (r1,) = h.wait([first])
    assert r1.job_id == first and r1.ok
    (r2,) = h.wait([second], timeout=30)
    assert r2.job_id == second
    h.close()


def test_wait_returns_results_in_the_order_asked_and_refuses_unknown_ids() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    a = h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))
    b = h.submit(_store([4, 5, 6, 7], poisoned_chunks(ctx, 1)))
    assert [r.job_id for r in h.wait([b, a, b])] == [b, a]
    with pytest.raises(UnknownTransferError, match=f"job {a} "):
        h.wait([a])  # already reported
    with pytest.raises(UnknownTransferError):
        h.wait([12345])  # never issued
    assert issubclass(UnknownTransferError, KeyError)
    h.close()


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize(
    "ids, error, match",
    [
        ([0, 1, NB, 3], BlockIdError, f"block id {NB} at position 2"),
        ([0, -1, 2, 3], BlockIdError, "block id -1 at position 1"),
        ([0.0, 1.0, 2.0, 3.0], BlockIdError, "integers"),
        ([0, 1, 2], ChunkMismatchError, "4 blocks but 3"),
    ],
)
def test_a_bad_job_fails_on_its_result_and_writes_nothing(
    direction: Direction, ids: list[int], error: type, match: str
) -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    before = snapshot(ctx)
    good_chunks = poisoned_chunks(ctx, 1)
    bad_chunks = poisoned_chunks(ctx, 1)
    payload = [t.clone() for t in bad_chunks]
    good = h.submit(_store([12, 13, 14, 15], good_chunks))  # jobs around it still run
    bad = h.submit(TransferJob(direction, ids, tuple(bad_chunks)))
    after = h.submit(_store([16, 17, 18, 19], poisoned_chunks(ctx, 1)))
    r_good, r_bad, r_after = h.wait([good, bad, after])
    assert r_good.ok and r_after.ok
    assert not r_bad.ok and isinstance(r_bad.error, error)
    assert match in str(r_bad.error)
    assert (r_bad.blocks, r_bad.bytes) == (0, 0)
    assert unchanged(ctx, before)
    assert torch.equal(bad_chunks[0].view(torch.uint8), payload[0].view(torch.uint8))
    assert bool((bad_chunks[0].view(torch.uint8) == POISON).all())
    h.close()


def test_a_job_whose_turn_comes_after_its_deadline_writes_nothing() -> None:
    """The engine passes its caller's deadline as the job's ``deadline``: a job queued behind a slow
    one must not start once the caller stopped owning the blocks."""
    ctx = make_context()
    gate = Gate()
    h = gated_handler(ctx, gate)
    before = snapshot(ctx)
    held = h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))
    late_chunks = poisoned_chunks(ctx, 1)
    past, never = Deadline(0.0), Deadline(float("inf"))
    late = h.submit(TransferJob(Direction.FROM_CHUNKS, [4, 5, 6, 7], tuple(late_chunks), deadline=past))
    timely_chunks = tuple(poisoned_chunks(ctx, 1))
    timely = h.submit(TransferJob(Direction.TO_CHUNKS, [8, 9, 10, 11], timely_chunks, deadline=never))
    assert gate.entered.wait(10)
    gate.opened.set()
    r_held, r_late, r_timely = h.wait([held, late, timely])
    assert r_held.ok and r_timely.ok
    assert isinstance(r_late.error, DeadlineExceededError) and (r_late.blocks, r_late.bytes) == (0, 0)
    assert unchanged(ctx, before)  # the refused load wrote nothing into the engine's blocks
    h.close()


@pytest.mark.parametrize(
    "raised, error",
    [
        (_native.BlockIdOutOfRange("block id 99 at position 0 is outside [0, 32)"), BlockIdError),
        (ValueError("last_chunk_blocks"), ChunkMismatchError),
        (RuntimeError("boom"), TransferError),
    ],
)
def test_a_failing_copy_is_reported_on_its_result(raised: Exception, error: type) -> None:
    ctx = make_context()

    def failing(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        raise raised

    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors, copy=failing)
    (r,) = h.wait([h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))])
    assert isinstance(r.error, error) and not r.ok
    assert (r.blocks, r.bytes) == (0, 0)
    (r2,) = h.wait([h.submit(_store([4, 5, 6, 7], poisoned_chunks(ctx, 1)))])
    assert not r2.ok  # the worker survives a failed copy and runs the next job
    h.close()


def test_close_waits_for_jobs_in_flight_then_refuses_new_ones() -> None:
    ctx = make_context()
    gate = Gate()
    h = gated_handler(ctx, gate)
    chunks = [poisoned_chunks(ctx, 1) for _ in range(3)]
    ids = [h.submit(_store([4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], c)) for i, c in enumerate(chunks)]
    assert gate.entered.wait(5)
    closer = threading.Thread(target=h.close)
    closer.start()
    closer.join(0.02)
    assert closer.is_alive()  # the gated job holds close
    gate.opened.set()
    closer.join()
    results = h.get_finished()  # still collectable after close
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    for i, c in enumerate(chunks):
        want = _gathered(ctx, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        assert torch.equal(c[0].view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(TransferError, match="closed"):
        h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))
    h.close()  # idempotent


def test_an_idle_worker_leaves_and_the_next_submit_starts_another() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors, idle_exit_s=0.0)
    for i in range(5):
        (r,) = h.wait([h.submit(_store([i, i + 1, i + 2, i + 3], poisoned_chunks(ctx, 1)))])
        assert r.ok
    h.close()


def test_submit_from_many_threads() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    got: list[int] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(10):
            start = (seed * 10 + i) % (NB - 4)
            job_id = h.submit(_store(list(range(start, start + 4)), poisoned_chunks(ctx, 1)))
            with lock:
                got.append(job_id)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = h.wait(got)
    assert sorted(got) == list(range(40)) and len(results) == 40 and all(r.ok for r in results)
    h.close()


def test_a_malformed_job_fails_alone_and_the_worker_goes_on() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    broken = h.submit(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], ("not a tensor",)))  # type: ignore[arg-type]
    fine = h.submit(_store([0, 1, 2, 3], poisoned_chunks(ctx, 1)))
    r_broken, r_fine = h.wait([broken, fine])
    assert isinstance(r_broken.error, TransferError) and "AttributeError" in str(r_broken.error)
    assert r_fine.ok
    h.close()


@pytest.mark.parametrize("direction", [Direction.TO_CHUNKS, Direction.FROM_CHUNKS])
def test_a_job_naming_a_device_event_is_refused_and_writes_nothing(direction: Direction) -> None:
    """A CPU cache has no stream to wait on an event with (``TransferJob.after``): copying
    anyway could read blocks the engine is still writing, so the job fails, typed."""
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    before = snapshot(ctx)
    chunks = poisoned_chunks(ctx, 1)
    refused = h.submit(TransferJob(direction, [0, 1, 2, 3], tuple(chunks), after=object()))
    fine = h.submit(_store([4, 5, 6, 7], poisoned_chunks(ctx, 1)))
    r_refused, r_fine = h.wait([refused, fine])
    assert isinstance(r_refused.error, CudaUnavailableError) and "CUDA event" in str(r_refused.error)
    assert (r_refused.blocks, r_refused.bytes) == (0, 0)
    assert unchanged(ctx, before) and bool((chunks[0].view(torch.uint8) == POISON).all())
    assert r_fine.ok
    h.close()


class _MembershipOnly:
    """Job ids a caller keeps (the engine's completer: every job it has in flight), which a
    handler may only ask about, never walk: walking them at each result made a store flood of
    n jobs cost the completer O(n^2) under the GIL (30 s of CPU for 5,000 stores)."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = set(ids)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ids

    def __iter__(self) -> Any:
        raise AssertionError("the handler walked every id in flight")

    def __len__(self) -> int:
        return len(self._ids)


def test_wait_any_in_asks_only_about_the_jobs_that_finished() -> None:
    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    chunks = [ctx.allocate_chunks(1)[0] for _ in range(3)]
    ids = [h.submit(_store([4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], [c])) for i, c in enumerate(chunks)]
    other = h.submit(_store([20, 21, 22, 23], [ctx.allocate_chunks(1)[0]]))  # not the caller's
    got: list[int] = []
    while len(got) < 3:
        got += [r.job_id for r in h.wait_any_in(_MembershipOnly(ids), timeout=10)]
    assert sorted(got) == ids  # each once, and never another caller's result
    assert [r.job_id for r in h.wait([other])] == [other]
    h.close()


def test_a_small_copy_runs_on_one_thread_a_large_one_on_all() -> None:
    """Each parallel copy leaves OpenMP's threads spinning for their next task (libgomp's
    default wait policy): a flood of small stores, one parallel copy each, spent two thirds of
    the daemon's CPU spinning (30 s against 9 s for 5,000 stores of 256 KiB), the other
    tenants' CPU. A copy too small to gain from threads runs on the copying thread alone."""
    threads: dict[int, int] = {}

    def copy(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        threads[job.nbytes] = num_threads
        native_cpu_copy(table, job, num_threads)

    ctx = make_context()
    h = CpuTransferHandler(page_table(ctx), ctx.geometry, 0, owners=ctx.tensors, copy=copy,
                           parallel_min_bytes=8 * ctx.geometry.bytes_per_block)  # fmt: skip
    small = h.submit(_store([0, 1, 2, 3], ctx.allocate_chunks(1)))  # 4 blocks
    large = h.submit(_store(list(range(8, 24)), ctx.allocate_chunks(4)))  # 16 blocks
    assert all(r.ok for r in h.wait([small, large]))
    bpb = ctx.geometry.bytes_per_block
    assert threads == {4 * bpb: 1, 16 * bpb: 0}  # 0: the handler's own (every OpenMP thread)
    h.close()
