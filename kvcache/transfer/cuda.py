"""CUDA transfers: the native kernels launched on the handler's own stream, tracked by events.

Separate from the CPU handler because a GPU needs no worker thread: the stream orders
the jobs and a pair of CUDA events per job says when it ran, so no host thread ever
synchronises on a copy it does not have to wait for.

Run on a GPU: an H200 on 2026-11-26 (``tests/transfer/test_cuda.py`` and every other CUDA
test passed, compute-sanitizer memcheck clean; docs/benchmarks.md has the figures).

NOTE: the native launch stages block ids through two pinned slots used in turn, so a
``submit`` returns at once while at most two copies are queued ahead of it on the stream;
a deeper queue waits on the host for the oldest upload (a bounded, not a blocking, queue).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache import _native
from kvcache.errors import KvcacheError, TransferError, UnknownTransferError
from kvcache.geometry import Geometry
from kvcache.transfer.base import TransferHandler, TransferJob, TransferResult
from kvcache.transfer.validate import (
    CheckedJob,
    check_job,
    check_start,
    cuda_error,
    cuda_errors,
    native_error,
)

_POLL_START_S = 20e-6  # first back-off of a bounded wait; doubles up to _POLL_MAX_S
_POLL_MAX_S = 1e-3


@dataclass(eq=False)
class _InFlight:
    job_id: int
    job: TransferJob  # keeps pinned-host chunks alive until the stream is past the copy
    checked: CheckedJob | None
    start: Any = None  # torch.cuda.Event(enable_timing=True), None for a job never launched
    end: Any = None
    error: KvcacheError | None = None


class CudaTransferHandler(TransferHandler):
    """Launches each job on one stream of its own; completion is tracked with CUDA events.

    Ordering with the engine: ``submit`` makes the handler's stream wait for the work
    queued so far on the caller's current stream (``wait_stream``: a device-side wait,
    the host returns at once), so a store reads the blocks the engine just wrote, and for
    the job's ``after`` event (the engine's writes on another stream or in another
    process; ``wait_event``, on the device too). The other way round, the engine must not
    read blocks a load is still writing: call ``wait_on_stream(job_id)`` to make the
    engine's stream wait for the job on the device, or ``wait`` to block the host. Jobs
    run in submission order because they share one stream; ``get_finished`` polls their
    events (``query``, never blocking).
    """

    def __init__(
        self,
        table: _native.PageTable,
        geometry: Geometry,
        owners: Sequence[torch.Tensor] = (),
    ) -> None:
        self._geometry = geometry
        self._device = geometry.device
        self._owners = tuple(owners)  # the engine memory whose addresses the table holds
        index = self._device.index if self._device.index is not None else 0
        max_chunks = max(1, -(-geometry.max_block_ids // geometry.blocks_per_chunk))
        with cuda_errors(f"opening the CUDA transfer handler on {self._device}"):
            self._native = _native.CudaTransfer(table, index, geometry.max_block_ids, max_chunks)
            self._stream = torch.cuda.Stream(device=self._device)
            # Re-recorded by every launch (under the lock): a stream wait binds to the
            # event's record at the time of the wait, so reuse is safe and saves the fresh
            # event ``wait_stream`` would make per copy.
            self._engine_done = torch.cuda.Event()
        self._lock = threading.Lock()
        self._pending: deque[_InFlight] = deque()  # submission order = stream order
        self._finished: dict[int, TransferResult] = {}
        self._next_id = 0
        self._closed = False

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream every copy of this handler runs on."""
        return self._stream

    def submit(self, job: TransferJob) -> int:
        checked: CheckedJob | None = None
        error: KvcacheError | None = None
        try:
            check_start(job)
            checked = check_job(job, self._geometry)
        except Exception as err:  # a malformed job (not just a bad one) fails alone, typed
            error = native_error(err)
        with self._lock:  # id order must equal stream order
            if self._closed:
                raise TransferError("the transfer handler is closed")
            entry = _InFlight(self._next_id, job, checked, error=error)
            self._next_id += 1
            if checked is not None:
                self._launch(entry, checked)
            self._pending.append(entry)
        return entry.job_id

    def _launch(self, entry: _InFlight, job: CheckedJob) -> None:
        stream = self._stream
        try:
            self._engine_done.record(torch.cuda.current_stream(self._device))
            stream.wait_event(self._engine_done)
            if entry.job.after is not None:  # before ``start``: the wait is not the copy's time
                stream.wait_event(entry.job.after)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        except Exception as err:  # nothing was queued: the job fails alone, never launched
            entry.error = cuda_error(err, "queueing a copy on the CUDA stream")
            return
        entry.start, entry.end = start, end
        try:
            self._native.copy(
                job.block_ids,
                job.chunk_ptrs,
                job.blocks_per_chunk,
                job.last_chunk_blocks,
                job.skip_blocks,
                job.to_chunks,
                stream.cuda_stream,
            )
        except Exception as err:  # refused before launch: nothing was written
            entry.error = native_error(err)
        try:
            entry.end.record(stream)
            for chunk in entry.job.chunks:
                if chunk.is_cuda:  # the caching allocator must not hand this memory out early
                    chunk.record_stream(stream)
        except Exception as err:  # completion cannot be tracked: wait here, report it failed
            entry.error = cuda_error(err, "recording a copy's end on the CUDA stream")
            entry.end = None
            with contextlib.suppress(Exception):
                stream.synchronize()

    def wait_on_stream(self, job_id: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the caller's current one) wait on the device for the
        job; the host does not block. A job already finished needs no wait."""
        with self._lock:
            entry = next((e for e in self._pending if e.job_id == job_id), None)
        if entry is not None and entry.end is not None:
            with cuda_errors("ordering a stream after a copy"):
                target = stream if stream is not None else torch.cuda.current_stream(self._device)
                target.wait_event(entry.end)

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            self._collect()
            out = list(self._finished.values())
            self._finished.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        ids = list(dict.fromkeys(job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = {e.job_id: e for e in self._pending}
            for i in ids:
                if i not in pending and i not in self._finished:
                    raise UnknownTransferError(
                        f"transfer job {i} was never submitted here or was already reported"
                    )
            newest = max((i for i in ids if i in pending), default=-1)
            # stream order: the newest launched job up to ``newest`` implies all before it
            # (a job that failed its checks has no event; it is done once those before are)
            last = next(
                (e for e in reversed(self._pending) if e.job_id <= newest and e.end is not None), None
            )
        if last is not None:
            self._block_until(last.end, deadline)
        with self._lock:
            self._collect()
            return [self._finished.pop(i) for i in ids if i in self._finished]

    def drain(self) -> None:
        with self._lock:
            last = next((e for e in reversed(self._pending) if e.end is not None), None)
        if last is not None:  # stream order: the newest launched job implies the rest
            self._block_until(last.end, None)
        with self._lock:
            self._collect()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drain()

    @staticmethod
    def _block_until(event: Any, deadline: float | None) -> None:
        """Host wait for ``event``: ``synchronize`` when unbounded; bounded, poll ``query``
        with a short back-off (a CUDA event wait takes no timeout)."""
        try:
            if deadline is None:
                event.synchronize()
                return
            pause = _POLL_START_S
            while not event.query() and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        except RuntimeError:
            return  # a device fault: _collect reports it on the job's result

    def _collect(self) -> None:
        """Moves finished jobs, oldest first, to ``_finished``; the caller holds the lock."""
        while self._pending:
            entry = self._pending[0]
            result = self._result_if_done(entry)
            if result is None:
                return
            self._pending.popleft()
            self._finished[entry.job_id] = result

    @staticmethod
    def _result_if_done(entry: _InFlight) -> TransferResult | None:
        direction = entry.job.direction
        if entry.end is None:  # failed its checks: never launched
            return TransferResult(entry.job_id, direction, 0, 0, 0.0, entry.error)
        try:
            if not entry.end.query():
                return None
            seconds = entry.start.elapsed_time(entry.end) / 1e3
        except RuntimeError as err:  # a fault on the device surfaces on the next query
            return TransferResult(entry.job_id, direction, 0, 0, 0.0, native_error(err))
        if entry.error is not None or entry.checked is None:
            return TransferResult(entry.job_id, direction, 0, 0, seconds, entry.error)
        return TransferResult(entry.job_id, direction, entry.checked.blocks, entry.checked.nbytes, seconds)


__all__ = ["CudaTransferHandler"]
