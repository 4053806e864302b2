"""The CUDA handler's bookkeeping on a CPU: its stream, events and native launch replaced by
a model of one in-order stream that the test advances. Checks what the handler decides
(ordering with the caller's stream, which event a wait blocks on, results in order, typed
errors, drain and close) without a GPU; ``test_cuda.py`` checks the real thing on one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache import _native
from kvcache.deadline import Deadline
from kvcache.errors import BlockIdError, ChunkMismatchError, CudaError, DeadlineExceededError, TransferError
from kvcache.transfer import Direction, TransferJob
from kvcache.transfer import cuda as cuda_mod
from tests.transfer.helpers import NB, make_context, page_table


class FakeGpu:
    """One in-order stream: ``launched`` items queued, the first ``completed`` of them run."""

    def __init__(self) -> None:
        self.launched = 0
        self.completed = 0
        self.log: list[tuple[str, Any]] = []
        self.fault = False

    def run_all(self) -> None:
        self.completed = self.launched


class FakeEvent:
    gpu: FakeGpu

    def __init__(self, enable_timing: bool = False) -> None:
        self.seq: int | None = None

    def record(self, stream: FakeStream) -> None:
        self.seq = self.gpu.launched
        # the copy stream's own events are "record"; a mark on another stream names it
        entry = ("record", self.seq) if stream.name == "copy" else ("mark", (stream.name, self.seq))
        self.gpu.log.append(entry)

    def query(self) -> bool:
        if self.gpu.fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.seq is None or self.gpu.completed >= self.seq

    def synchronize(self) -> None:
        self.gpu.log.append(("synchronize", self.seq))
        if self.seq is not None:
            self.gpu.completed = max(self.gpu.completed, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.0  # ms


class FakeStream:
    cuda_stream = 1234

    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu, self.name = gpu, name

    def wait_stream(self, other: FakeStream) -> None:
        self.gpu.log.append(("wait_stream", (self.name, other.name)))

    def wait_event(self, event: FakeEvent) -> None:
        self.gpu.log.append(("wait_event", (self.name, event.seq)))


class FakeNative:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.raise_next: Exception | None = None

    def copy(self, ids: Any, ptrs: Any, bpc: int, last: int, skip: int, to_chunks: bool, stream: int) -> None:
        if self.raise_next is not None:
            err, self.raise_next = self.raise_next, None
            raise err
        assert stream == FakeStream.cuda_stream
        self.gpu.launched += 1
        self.gpu.log.append(("copy", (list(ids), to_chunks)))


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> tuple[cuda_mod.CudaTransferHandler, FakeGpu, FakeNative, Any]:
    gpu = FakeGpu()
    native = FakeNative(gpu)
    FakeEvent.gpu = gpu
    engine_stream = FakeStream(gpu, "engine")
    monkeypatch.setattr(cuda_mod._native, "CudaTransfer", lambda *a: native)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(gpu, "copy"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: engine_stream)
    ctx = make_context()  # a CPU cache: its geometry and chunks stand in for the GPU's
    handler = cuda_mod.CudaTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)
    return handler, gpu, native, ctx


def _store(ctx: Any, ids: list[int]) -> TransferJob:
    return TransferJob(Direction.TO_CHUNKS, ids, tuple(ctx.allocate_chunks(1)))


def test_submit_orders_after_the_callers_stream_and_never_waits(rig: Any) -> None:
    h, gpu, _, ctx = rig
    a = h.submit(_store(ctx, [0, 1, 2, 3]))
    b = h.submit(_store(ctx, [4, 5, 6, 7]))
    assert [e for e in gpu.log if e[0] not in ("copy", "record")] == [
        ("mark", ("engine", 0)),  # what the caller's stream has queued so far...
        ("wait_event", ("copy", 0)),  # ...comes first on the copy stream, a device-side wait
        ("mark", ("engine", 1)),
        ("wait_event", ("copy", 1)),
    ]
    assert not any(e[0] == "synchronize" for e in gpu.log)
    assert h.get_finished() == []  # the stream has not run yet: query says so
    gpu.completed = 1
    (ra,) = h.get_finished()
    assert ra.job_id == a and ra.ok and ra.seconds == pytest.approx(2e-3)
    assert ra.blocks == 4 and ra.bytes == 4 * ctx.block_size * ctx.bytes_per_token
    gpu.run_all()
    assert [r.job_id for r in h.get_finished()] == [b]


def test_wait_blocks_on_the_newest_launched_job_it_needs(rig: Any) -> None:
    h, gpu, _, ctx = rig
    ids = [h.submit(_store(ctx, [i, i + 1, i + 2, i + 3])) for i in range(4)]
    results = h.wait([ids[2], ids[0]])
    assert [r.job_id for r in results] == [ids[2], ids[0]]
    assert ("synchronize", 3) in gpu.log and gpu.completed == 3  # job 2's end event, no further
    assert [r.job_id for r in h.get_finished()] == [ids[1]]
    assert h.wait([ids[3]], timeout=0.005) == []  # bounded: the stream never got there
    gpu.run_all()
    assert [r.job_id for r in h.wait([ids[3]], timeout=0.005)] == [ids[3]]


def test_a_job_failing_its_checks_waits_its_turn_and_is_reported_in_order(rig: Any) -> None:
    h, gpu, _, ctx = rig
    first = h.submit(_store(ctx, [0, 1, 2, 3]))
    bad = h.submit(_store(ctx, [0, 1, NB, 3]))
    assert gpu.launched == 1  # the bad job never reached the device
    assert h.get_finished() == []  # it is behind the unfinished first job
    (r,) = h.wait([bad])  # blocks on the first job's event, then reports the bad one
    assert isinstance(r.error, BlockIdError) and (r.blocks, r.bytes) == (0, 0)
    assert [x.job_id for x in h.get_finished()] == [first]


def test_a_job_past_its_deadline_at_launch_is_never_launched(rig: Any) -> None:
    h, gpu, _, ctx = rig
    chunks = tuple(ctx.allocate_chunks(1))
    late = h.submit(TransferJob(Direction.FROM_CHUNKS, [0, 1, 2, 3], chunks, deadline=Deadline(0.0)))
    assert gpu.launched == 0  # checked on the host at launch: the device never sees it
    (r,) = h.wait([late])
    assert isinstance(r.error, DeadlineExceededError) and (r.blocks, r.bytes) == (0, 0)


@pytest.mark.parametrize(
    "raised, error",
    [
        (_native.BlockIdOutOfRange("block id 99 at position 0"), BlockIdError),
        (ValueError("ids"), ChunkMismatchError),
    ],
)
def test_a_launch_refused_by_the_native_side_is_reported_typed(
    rig: Any, raised: Exception, error: type
) -> None:
    h, _, native, ctx = rig
    native.raise_next = raised
    (r,) = h.wait([h.submit(_store(ctx, [0, 1, 2, 3]))])
    assert isinstance(r.error, error) and r.bytes == 0


def test_a_device_fault_is_reported_on_the_result(rig: Any) -> None:
    h, gpu, _, ctx = rig
    job = h.submit(_store(ctx, [0, 1, 2, 3]))
    gpu.fault = True
    (r,) = h.wait([job])
    assert isinstance(r.error, TransferError) and "illegal memory access" in str(r.error)


def test_a_stream_that_fails_before_the_launch_fails_the_job_typed(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA failure while queueing (the stream, its events) never escapes ``submit``: the
    job fails alone, typed, never launched, and the next one runs."""
    h, gpu, _, ctx = rig
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(self: FakeStream, other: FakeEvent) -> None:
        raise RuntimeError("CUDA error: unspecified launch failure")

    with monkeypatch.context() as patch:
        patch.setattr(FakeStream, "wait_event", broken)
        failed = h.submit(_store(ctx, [0, 1, 2, 3]))
    ok = h.submit(_store(ctx, [4, 5, 6, 7]))
    gpu.run_all()
    first, second = h.wait([failed, ok])
    assert type(first.error) is CudaError and "launch failure" in str(first.error) and first.bytes == 0
    assert second.ok and gpu.launched == 1


def test_a_jobs_event_is_waited_for_on_the_device_before_the_copy(rig: Any) -> None:
    """``after`` (the engine's writes, on a stream of its own or in another process): the
    copy stream waits for it on the device, after the caller's stream and before the copy's
    start event, so the wait is not counted as the copy's time; the host never blocks."""
    h, gpu, _, ctx = rig
    gpu.launched = 5  # the engine's work queued so far
    written = FakeEvent()
    written.record(FakeStream(gpu, "engine-side"))
    gpu.log.clear()
    job = TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(ctx.allocate_chunks(1)), after=written)
    h.submit(job)
    assert gpu.log == [
        ("mark", ("engine", 5)),
        ("wait_event", ("copy", 5)),  # the caller's stream
        ("wait_event", ("copy", 5)),  # the job's event
        ("record", 5),  # the copy's start, behind the waits
        ("copy", ([0, 1, 2, 3], True)),
        ("record", 6),
    ]
    h.submit(_store(ctx, [4, 5, 6, 7]))  # a job without an event: no wait
    # the second job waits only for the caller's stream (now past the first copy), no event
    assert [e for e in gpu.log if e[0] == "wait_event"] == [("wait_event", ("copy", 5))] * 2 + [
        ("wait_event", ("copy", 6))
    ]


def test_an_event_the_stream_cannot_wait_for_fails_the_job_typed(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, gpu, _, ctx = rig
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refused(self: FakeStream, event: FakeEvent) -> None:
        raise RuntimeError("CUDA error: invalid resource handle")

    with monkeypatch.context() as patch:
        patch.setattr(FakeStream, "wait_event", refused)
        failed = h.submit(TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(ctx.allocate_chunks(1)),
                                      after=FakeEvent()))  # fmt: skip
    ok = h.submit(_store(ctx, [4, 5, 6, 7]))
    gpu.run_all()
    first, second = h.wait([failed, ok])
    assert type(first.error) is CudaError and "invalid resource handle" in str(first.error)
    assert first.bytes == 0 and second.ok and gpu.launched == 1  # never launched


def test_wait_on_stream_is_a_device_side_wait(rig: Any) -> None:
    h, gpu, _, ctx = rig
    job = h.submit(TransferJob(Direction.FROM_CHUNKS, [0, 1, 2, 3], tuple(ctx.allocate_chunks(1))))
    h.wait_on_stream(job)
    assert gpu.log[-1] == ("wait_event", ("engine", 1))
    assert gpu.completed == 0  # the host did not wait


def test_drain_and_close(rig: Any) -> None:
    h, gpu, _, ctx = rig
    ids = [h.submit(_store(ctx, [i, i + 1, i + 2, i + 3])) for i in range(3)]
    h.close()
    assert gpu.completed == 3
    assert [r.job_id for r in h.get_finished()] == ids
    with pytest.raises(TransferError, match="closed"):
        h.submit(_store(ctx, [0, 1, 2, 3]))
