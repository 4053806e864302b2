"""CPU transfers: the native CPU twin run off the caller's thread, large jobs in pieces.

Separate from the CUDA handler because the CPU has no stream to order work on: a worker
thread plays the stream's part, so CPU callers get the same submit / poll / wait
behaviour as GPU callers and the CPU test suite exercises every asynchronous rule.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcache import _native
from kvcache.errors import CudaUnavailableError, TransferError, UnknownTransferError
from kvcache.geometry import Geometry
from kvcache.idle import wait_for_work
from kvcache.transfer.base import CopyPriority, TransferHandler, TransferJob, TransferResult
from kvcache.transfer.lowered import LoweredCopy
from kvcache.transfer.pieces import Footprint, chunks_per_piece, first_chunk, piece
from kvcache.transfer.validate import CheckedJob, check_job, check_start, native_error

#: The native copy's signature; tests pass a wrapper that holds a job in flight.
CopyFn = Callable[[_native.PageTable, CheckedJob, int], None]


def native_cpu_copy(table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
    """The native CPU twin (releases the GIL; OpenMP spreads the pages over threads)."""
    _native.cpu_copy(table, *job.native_args(), num_threads)


PIECE_BYTES = 16 << 20
"""A job larger than this runs as pieces of whole chunks (at least one chunk each), so a later
small job waits for one piece of it, not for all of it."""


PARALLEL_MIN_BYTES = 4 << 20
"""A piece smaller than this is copied by the worker thread alone, not by OpenMP's threads:
after each parallel copy they spin waiting for the next (libgomp's default wait policy), and
a flood of small stores, one parallel copy each, spent about two thirds of the daemon's CPU
spinning (30 s against 9 s for 5,000 stores of 256 KiB, 2 cores), taken from every tenant.
A copy this small gains little from threads."""


@dataclass(eq=False)
class _Queued:
    """A submitted job; the worker's own state of it (only the worker writes it)."""

    job_id: int
    job: TransferJob  # holds the chunk tensors alive until the copy finished
    checked: CheckedJob | None = None
    footprint: Footprint | None = None
    blockers: tuple[_Queued, ...] = ()  # the latest earlier job touching each of its blocks and chunks
    next_chunk: int = -1  # -1: not checked yet
    blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    result: TransferResult | None = None
    charged: int = 0  # bytes charged to ``priority`` at submit, credited as it leaves the queue


class CpuTransferHandler(TransferHandler):
    """Runs the native CPU copy on one worker thread, a piece at a time.

    Order: a job of more than ``piece_bytes`` is cut into pieces of whole chunks. The worker
    takes turns, one piece each, among the jobs that share no block and no chunk with any
    earlier unfinished job (``pieces.Footprint``); a job that does share waits until those
    earlier jobs finished, so it sees every byte they wrote. A small job submitted behind a
    large one therefore waits for one piece of it, not all of it, and finishes first. The
    start deadline (``TransferJob.deadline``) is checked before every piece: a job stops, with
    ``DeadlineExceededError`` on its result, rather than touch the blocks after it.

    ``submit`` only queues the job: the worker checks it (``check_job``) right before
    copying, so the caller's thread does no per-id work. Right after a large copy the
    caller's caches are cold, and the checks alone then cost about as much as 1 % of a
    256 MiB copy (measured: ``python -m kvcache.bench transfer``).

    One worker, not several: the native copy already spreads each job's pages over
    ``num_threads`` OpenMP threads, so a second concurrent job would only split the same
    memory bandwidth, and would break the in-order promise of ``TransferHandler``.
    The worker starts on the first submit and exits after ``idle_exit_s`` without work,
    so a registered but idle cache holds no thread and needs no explicit ``close``.

    ``priority`` (the daemon: its principal's ``server.copy_share``) is charged each job's
    bytes at submit, credited them when it leaves the queue, and asked before each piece
    whether the copying gives way: then the piece is
    copied by ``lowered_copy`` (``LoweredCopy``: a native thread in the lowest CPU class), so
    the other threads that want the core take it first. The worker waits for it, so the order
    above is unchanged; only the copy's priority differs. A closing handler never gives way:
    whoever closes it (an unregister) waits for its copies.
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
        geometry: Geometry,
        num_threads: int = 0,
        owners: Sequence[torch.Tensor] = (),
        copy: CopyFn = native_cpu_copy,
        idle_exit_s: float = 2.0,
        piece_bytes: int = PIECE_BYTES,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
        priority: CopyPriority | None = None,
        lowered_copy: CopyFn | None = None,
    ) -> None:
        self._table = table
        self._geometry = geometry
        self._num_threads = num_threads
        self._owners = tuple(owners)
        self._copy = copy
        self._idle_exit_s = idle_exit_s
        self._parallel_min_bytes = parallel_min_bytes
        self._priority = priority
        self._lowered_copy: CopyFn | None = None
        if priority is not None:
            self._lowered_copy = lowered_copy if lowered_copy is not None else LoweredCopy()
        self._cv = threading.Condition()
        self._queue: deque[_Queued] = deque()  # submitted, not finished; [0] may be running
        self._finished: dict[int, TransferResult] = {}  # finished, not collected (in order)
        self._next_id = 0
        self._worker: threading.Thread | None = None
        self._closed = False
        bpc, block_bytes = geometry.blocks_per_chunk, geometry.bytes_per_block
        self._piece_chunks = chunks_per_piece(piece_bytes, bpc, block_bytes)
        self._last_turn = -1  # the job id that ran the latest piece (worker only)
        # (worker only) the latest checked, unfinished job touching each engine block and
        # each chunk (by address): a new job waits on those, each of which waits on the one
        # before it, so one check costs O(its own ids), never O(jobs queued)
        self._last_block: dict[int, _Queued] = {}
        self._last_chunk: dict[int, _Queued] = {}
        self._interrupts = 0  # wait_any returns when this changes

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    def submit(self, job: TransferJob) -> int:
        with self._cv:
            if self._closed:
                raise TransferError("the transfer handler is closed")
            job_id = self._next_id
            self._next_id += 1
            queued = _Queued(job_id, job)
            if self._worker is None:  # started first: a job is queued (and charged) only with a worker
                worker = threading.Thread(target=self._run, name="kvcache-transfer-cpu", daemon=False)
                worker.start()
                self._worker = worker
            else:
                self._cv.notify_all()
            if self._priority is not None:
                queued.charged = self._bytes_of(job)
                self._priority.charge(queued.charged)
            self._queue.append(queued)
        return job_id

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            out = sorted(self._finished.values(), key=lambda r: r.job_id)
            self._finished.clear()
        return out

    def wait_any(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        ids = list(dict.fromkeys(job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._check_known(ids)
            interrupts = self._interrupts
            while ids and not any(i in self._finished for i in ids) and interrupts == self._interrupts:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
            return [self._finished.pop(i) for i in ids if i in self._finished]

    def wait_any_in(self, job_ids: Collection[int], timeout: float | None = None) -> list[TransferResult]:
        """As ``wait_any``, asking only about the finished jobs (O(results kept), not O(ids);
        an id never issued is not reported, it is just never finished)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            interrupts = self._interrupts
            while True:
                mine = [i for i in self._finished if i in job_ids]
                if mine or interrupts != self._interrupts:
                    return [self._finished.pop(i) for i in mine]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cv.wait(remaining)

    def interrupt(self) -> None:
        with self._cv:
            self._interrupts += 1
            self._cv.notify_all()

    def _check_known(self, ids: list[int]) -> None:
        queued = {q.job_id for q in self._queue}
        for i in ids:
            if i not in queued and i not in self._finished:
                raise UnknownTransferError(
                    f"transfer job {i} was never submitted here or was already reported"
                )

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        ids = list(dict.fromkeys(job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._check_known(ids)
            while not all(i in self._finished for i in ids):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
            return [self._finished.pop(i) for i in ids if i in self._finished]

    def drain(self) -> None:
        with self._cv:
            last = self._next_id - 1
            while any(q.job_id <= last for q in self._queue):
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
                items = list(self._queue)
            item = items[0]
            try:
                item = self._turn(items)
                self._step(item)
            except Exception as err:  # never lose the worker (and every waiter) to one job
                item.result = TransferResult(item.job_id, item.job.direction, 0, 0, 0.0, native_error(err))
            if item.result is not None:
                with self._cv:
                    self._queue.remove(item)
                    self._finished[item.job_id] = item.result
                    self._cv.notify_all()
                if self._priority is not None:
                    self._priority.charge(-item.charged)
                self._forget(item)

    def _turn(self, items: list[_Queued]) -> _Queued:
        """The job whose piece runs next: round robin, from the one after the latest turn,
        among the jobs none of whose blockers is still queued (the oldest always qualifies)."""
        for item in items:
            if item.next_chunk < 0:  # new since the last turn, checked in submission order
                self._prepare(item)
            if item.result is not None:  # failed its checks: reported at once
                return item
        first: _Queued | None = None
        for q in items:  # a finished job has its result and has left the queue
            if any(b.result is None for b in q.blockers):
                continue
            if q.job_id > self._last_turn:
                first = q
                break
            first = q if first is None else first
        assert first is not None  # the oldest job has no earlier one to wait on
        self._last_turn = first.job_id
        return first

    def _prepare(self, item: _Queued) -> None:
        """Check the job (off the caller's thread) and find the earlier jobs it must follow:
        for each of its blocks and chunks, the latest unfinished job touching it."""
        item.next_chunk = 0
        try:
            if item.job.after is not None:
                raise CudaUnavailableError(
                    "a copy of a CPU cache cannot wait for a CUDA event (TransferJob.after): "
                    "there is no stream to order it on; nothing was copied"
                )
            job = check_job(item.job, self._geometry)
        except Exception as err:  # a malformed job (not just a bad one) fails alone, typed
            item.result = TransferResult(item.job_id, item.job.direction, 0, 0, 0.0, native_error(err))
            return
        item.checked, item.footprint = job, Footprint.of(job)
        item.next_chunk = first_chunk(job)
        fp, blockers = item.footprint, {}
        for index, keys in ((self._last_block, fp.blocks.tolist()), (self._last_chunk, fp.chunks)):
            for key in keys:
                latest = index.get(key)
                if latest is not None and latest.result is None:
                    blockers[id(latest)] = latest
                index[key] = item
        item.blockers = tuple(blockers.values())

    def _forget(self, item: _Queued) -> None:
        """(worker) ``item`` finished: it is no longer the latest job touching its memory."""
        fp = item.footprint
        if fp is None:
            return
        for index, keys in ((self._last_block, fp.blocks.tolist()), (self._last_chunk, fp.chunks)):
            for key in keys:
                if index.get(key) is item:
                    del index[key]

    def _bytes_of(self, job: TransferJob) -> int:
        """The bytes ``job`` asks to copy, as the caller states it (checked later: 0 for one
        that is not even a sequence)."""
        try:
            return max(0, len(job.block_ids) - job.skip_blocks) * self._geometry.bytes_per_block
        except TypeError:
            return 0

    def _gives_way(self) -> bool:
        """``priority.gives_way()``, never while closing; one that fails counts as False
        (never lose the worker)."""
        assert self._priority is not None
        if self._closed:
            return False
        try:
            return bool(self._priority.gives_way())
        except Exception:
            return False

    def _step(self, item: _Queued) -> None:
        """Run the next piece of ``item``; sets its result once it is over."""
        job = item.checked
        if item.result is not None or job is None:
            return
        direction = item.job.direction
        try:
            check_start(item.job)  # before every piece: no byte moves after the deadline
        except Exception as err:
            item.result = TransferResult(item.job_id, direction, item.blocks, item.nbytes, item.seconds,
                                         native_error(err))  # fmt: skip
            return
        start, count = item.next_chunk, len(job.chunk_ptrs)
        stop = min(start + self._piece_chunks, count)
        part = job if (start, stop) == (0, count) else piece(job, start, stop, self._geometry.bytes_per_block)
        copy = self._lowered_copy if self._lowered_copy is not None and self._gives_way() else self._copy
        t0 = time.perf_counter()
        try:
            if part.blocks:
                threads = self._num_threads if part.nbytes >= self._parallel_min_bytes else 1
                copy(self._table, part, threads)
        except Exception as err:  # reported on the result, never raised on this thread
            item.seconds += time.perf_counter() - t0
            item.result = TransferResult(item.job_id, direction, item.blocks, item.nbytes, item.seconds,
                                         native_error(err))  # fmt: skip
            return
        item.seconds += time.perf_counter() - t0
        item.blocks += part.blocks
        item.nbytes += part.nbytes
        item.next_chunk = stop
        if stop >= count:
            item.result = TransferResult(item.job_id, direction, item.blocks, item.nbytes, item.seconds)


__all__ = [
    "PARALLEL_MIN_BYTES",
    "PIECE_BYTES",
    "CopyFn",
    "CpuTransferHandler",
    "LoweredCopy",
    "native_cpu_copy",
]
