"""CPU transfers: the native CPU twin run off the caller's thread.

Separate from the CUDA handler because the CPU has no stream to order work on: a worker
thread plays the stream's part, so CPU callers get the same submit / poll / wait
behaviour as GPU callers and the CPU test suite exercises every asynchronous rule.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcache import _native
from kvcache.errors import CudaUnavailableError, TransferError, UnknownTransferError
from kvcache.idle import wait_for_work
from kvcache.transfer.base import TransferHandler, TransferJob, TransferResult
from kvcache.transfer.validate import CheckedJob, ChunkGeometry, check_job, check_start, native_error

#: The native copy's signature; tests pass a wrapper that holds a job in flight.
CopyFn = Callable[[_native.PageTable, CheckedJob, int], None]


def native_cpu_copy(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
    """The native CPU twin (releases the GIL; OpenMP spreads the pages over threads)."""
    _native.cpu_copy(
        table,
        job.block_ids,
        job.chunk_ptrs,
        job.blocks_per_chunk,
        job.last_chunk_blocks,
        job.skip_blocks,
        job.to_chunks,
        num_threads,
    )


@dataclass(frozen=True, eq=False)
class _Queued:
    job_id: int
    job: TransferJob  # holds the chunk tensors alive until the copy finished


class CpuTransferHandler(TransferHandler):
    """Runs the native CPU copy on one worker thread, jobs in submission order.

    ``submit`` only queues the job: the worker checks it (``check_job``) right before
    copying, so the caller's thread does no per-id work. Right after a large copy the
    caller's caches are cold, and the checks alone then cost about as much as 1 % of a
    256 MiB copy (measured: ``python -m kvcache.bench transfer``).

    One worker, not several: the native copy already spreads each job's pages over
    ``num_threads`` OpenMP threads, so a second concurrent job would only split the same
    memory bandwidth, and would break the in-order promise of ``TransferHandler``.
    The worker starts on the first submit and exits after ``idle_exit_s`` without work,
    so a registered but idle cache holds no thread and needs no explicit ``close``.
    NOTE: the worker is not a daemon thread: one killed at interpreter exit while it
    re-takes the GIL (leaving the native copy) aborts the process ("terminate called
    without an active exception"). It finishes its queue instead, and an idle worker
    leaves within ``kvcache.idle.IDLE_SLICE_S`` once the main thread has ended.

    ``owners`` are kept alive for the handler's life: the engine tensors whose
    addresses ``table`` holds, which a queued job may still write.
    """

    def __init__(
        self,
        table: _native.PageTable,
        geometry: ChunkGeometry,
        num_threads: int = 0,
        owners: Sequence[torch.Tensor] = (),
        copy: CopyFn = native_cpu_copy,
        idle_exit_s: float = 2.0,
    ) -> None:
        self._table = table
        self._geometry = geometry
        self._num_threads = num_threads
        self._owners = tuple(owners)
        self._copy = copy
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._queue: deque[_Queued] = deque()  # submitted, not finished; [0] may be running
        self._finished: dict[int, TransferResult] = {}  # finished, not collected (in order)
        self._next_id = 0
        self._worker: threading.Thread | None = None
        self._closed = False

    @property
    def geometry(self) -> ChunkGeometry:
        return self._geometry

    def submit(self, job: TransferJob) -> int:
        with self._cv:
            if self._closed:
                raise TransferError("the transfer handler is closed")
            job_id = self._next_id
            self._next_id += 1
            self._queue.append(_Queued(job_id, job))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvcache-transfer-cpu", daemon=False)
                self._worker.start()
            else:
                self._cv.notify_all()
        return job_id

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            out = list(self._finished.values())
            self._finished.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        ids = list(dict.fromkeys(job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            queued = {q.job_id for q in self._queue}
            for i in ids:
                if i not in queued and i not in self._finished:
                    raise UnknownTransferError(
                        f"transfer job {i} was never submitted here or was already reported"
                    )
            while not all(i in self._finished for i in ids):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
            return [self._finished.pop(i) for i in ids if i in self._finished]

    def drain(self) -> None:
        with self._cv:
            last = self._next_id - 1
            while self._queue and self._queue[0].job_id <= last:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            while self._worker is not None:
                self._cv.wait()

    # -- worker ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if not wait_for_work(self._cv, self._queue, lambda: self._closed, self._idle_exit_s):
                    self._worker = None
                    self._cv.notify_all()
                    return
                item = self._queue[0]
            try:
                result = self._execute(item)
            except Exception as err:  # never lose the worker (and every waiter) to one job
                result = TransferResult(item.job_id, item.job.direction, 0, 0, 0.0, native_error(err))
            with self._cv:
                self._queue.popleft()
                self._finished[item.job_id] = result
                self._cv.notify_all()

    def _execute(self, item: _Queued) -> TransferResult:
        direction = item.job.direction
        try:
            if item.job.after is not None:
                raise CudaUnavailableError(
                    "a copy of a CPU cache cannot wait for a CUDA event (TransferJob.after): "
                    "there is no stream to order it on; nothing was copied"
                )
            job = check_job(item.job, self._geometry)
            check_start(item.job)  # last, right before the copy: the check nearest its start
        except Exception as err:  # a malformed job (not just a bad one) fails alone, typed
            return TransferResult(item.job_id, direction, 0, 0, 0.0, native_error(err))
        start = time.perf_counter()
        try:
            self._copy(self._table, job, self._num_threads)
        except Exception as err:  # reported on the result, never raised on this thread
            return TransferResult(
                item.job_id, direction, 0, 0, time.perf_counter() - start, native_error(err)
            )
        return TransferResult(item.job_id, direction, job.blocks, job.nbytes, time.perf_counter() - start)


__all__ = ["CopyFn", "CpuTransferHandler", "native_cpu_copy"]
