"""The asynchronous contract on the CUDA handler (skipped without a GPU and a CUDA build).

First run on a GPU: an H200, 2026-11-26 (all passed; ``scripts/gpu_check.sh`` runs them).
"""

from __future__ import annotations

import pytest
import torch

from kvcache import reference
from kvcache.errors import BlockIdError, TransferError
from kvcache.transfer import Direction, TransferJob
from tests.transfer.helpers import NB, POISON, make_context, poisoned_chunks, snapshot, unchanged

pytestmark = pytest.mark.cuda


def _handler(ctx: object):  # type: ignore[no-untyped-def]
    from kvcache.transfer.cuda import CudaTransferHandler

    handler = ctx.transfer  # type: ignore[attr-defined]
    assert isinstance(handler, CudaTransferHandler)
    return handler


@pytest.mark.parametrize("place", ["device", "pinned"])
def test_store_then_load_in_order_without_a_host_wait_between(place: str) -> None:
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    device, pin = ("cuda", False) if place == "device" else ("cpu", True)
    chunk = poisoned_chunks(ctx, 1, device=device, pin=pin)
    src, dst = [1, 2, 3, 4], [20, 21, 22, 23]
    want = reference.gather(ctx.tensors, ctx.format, ctx.shape, src).clone()
    a = h.submit(TransferJob(Direction.TO_CHUNKS, src, tuple(chunk)))
    b = h.submit(TransferJob(Direction.FROM_CHUNKS, dst, tuple(chunk)))
    h.wait_on_stream(b)  # the engine's stream waits on the device, the host does not
    got = reference.gather(ctx.tensors, ctx.format, ctx.shape, dst)  # runs on the current stream
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    results = h.wait([a, b])
    assert [r.job_id for r in results] == [a, b] and all(r.ok for r in results)
    assert results[0].bytes == 4 * ctx.block_size * ctx.bytes_per_token
    assert all(r.seconds > 0 for r in results)


def test_a_store_waits_on_the_device_for_the_engines_event() -> None:
    """The engine writes the blocks on a stream of its own, behind a slow kernel, and passes
    the event it recorded there as ``after``: the copy, submitted at once from a thread whose
    current stream knows nothing of that work, must store the written bytes, and its own
    time must not include the wait."""
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    ids = [4, 5, 6, 7]
    old = reference.gather(ctx.tensors, ctx.format, ctx.shape, ids).clone()
    fresh = [torch.randn_like(t) for t in ctx.tensors]
    writer = torch.cuda.Stream(device=ctx.device)
    writer.wait_stream(torch.cuda.current_stream(ctx.device))  # ``fresh`` is ready first
    written = torch.cuda.Event()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(400_000_000)  # the write lands long after the submit below
        for t, f in zip(ctx.tensors, fresh, strict=True):
            t.copy_(f)
        written.record(writer)
    chunk = poisoned_chunks(ctx, 1, device="cuda")
    job = h.submit(TransferJob(Direction.TO_CHUNKS, ids, tuple(chunk), after=written))
    assert not written.query()  # queued before the write landed: only the device wait orders it
    (r,) = h.wait([job])
    assert r.ok and r.seconds < 0.05
    torch.cuda.synchronize()
    want = reference.gather(ctx.tensors, ctx.format, ctx.shape, ids)
    assert torch.equal(chunk[0].view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(want.view(torch.uint8), old.view(torch.uint8))


def test_many_jobs_in_flight_and_get_finished_polls() -> None:
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    chunks = [poisoned_chunks(ctx, 1, device="cuda") for _ in range(64)]
    ids = [
        h.submit(TransferJob(Direction.TO_CHUNKS, [i % 28, i % 28 + 1, i % 28 + 2, i % 28 + 3], tuple(c)))
        for i, c in enumerate(chunks)
    ]
    h.drain()
    results = h.get_finished()
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)


def test_wait_with_timeout_returns_what_finished() -> None:
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    torch.cuda._sleep(200_000_000)  # the engine's stream is busy; the copy waits for it
    job = h.submit(
        TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(poisoned_chunks(ctx, 1, device="cuda")))
    )
    assert h.wait([job], timeout=0.001) == []
    (r,) = h.wait([job])
    assert r.ok


def test_bad_ids_fail_on_the_result_and_write_nothing() -> None:
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    before = snapshot(ctx)
    chunk = poisoned_chunks(ctx, 1, device="cuda")
    (r,) = h.wait([h.submit(TransferJob(Direction.FROM_CHUNKS, [0, 1, NB, 3], tuple(chunk)))])
    assert isinstance(r.error, BlockIdError) and (r.blocks, r.bytes) == (0, 0)
    assert unchanged(ctx, before)
    assert bool((chunk[0].view(torch.uint8) == POISON).all())


def test_close_drains_then_refuses() -> None:
    ctx = make_context(device="cuda")
    h = _handler(ctx)
    ids = [
        h.submit(
            TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(poisoned_chunks(ctx, 1, device="cuda")))
        )
        for _ in range(8)
    ]
    h.close()
    assert [r.job_id for r in h.get_finished()] == ids
    with pytest.raises(TransferError, match="closed"):
        h.submit(
            TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(poisoned_chunks(ctx, 1, device="cuda")))
        )
