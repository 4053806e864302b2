"""The transfer contract: submit a copy job, poll or wait for its result.

Separate from the handlers so that callers (the context, later the engine and the vLLM
connector) depend on this file alone, and a new backend is one more file beside it.

The life of a job, in call order::

    job_id = handler.submit(TransferJob(...))    # returns at once; never waits on the copy
    handler.get_finished()  -> [TransferResult]  # non-blocking poll: what finished since
    handler.wait([job_id], timeout)  -> [...]    # or block until those jobs finished
    handler.drain()                              # block until all submitted jobs finished
    handler.close()                              # refuse new jobs, then drain

Every result is handed out exactly once, by ``get_finished`` or by ``wait``; a handler
keeps each finished result until then, so a caller must collect what it submits.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvcache.deadline import Deadline
from kvcache.errors import KvcacheError
from kvcache.ids import Ids, RawIds

BlockIds = Ids | RawIds
"""Block ids of a job: checked ``Ids`` (a request's, checked when it was built), taken as they
are; or ids as a direct caller holds them, which the handler checks in the job's turn."""


class Direction(enum.Enum):
    """Which way the bytes go, named by the glossary's verbs (docs/architecture.md)."""

    TO_CHUNKS = "store"  # engine blocks -> kvcache chunks
    FROM_CHUNKS = "retrieve"  # kvcache chunks -> engine blocks


@dataclass(frozen=True, eq=False)
class TransferJob:
    """One copy between engine blocks and chunks, as the caller states it.

    Chunk ``c`` takes block ids ``[c * blocks_per_chunk, ...)``; every chunk but the last
    holds a full chunk, the last a whole number of blocks. The first ``skip_blocks`` ids
    are left alone in both directions (the engine already holds them on a retrieve). The job
    keeps its chunk tensors alive until the copy has finished, so a caller may drop its
    own references right after ``submit``; it must not change ``block_ids`` or the
    chunks' contents before the job's result is out (a handler may read them late).

    ``deadline`` (a ``Deadline``: a ``time.monotonic()`` moment): the caller stops owning
    the engine blocks then (a serving engine may hand them to another request), so a job
    that has not started by that time is refused with ``DeadlineExceededError`` and writes
    nothing.
    NOTE: the CPU handler checks it when the job's turn comes; a CUDA handler when it
    launches the job (at ``submit``), as the device's start time is not known to the host.

    ``after``: a CUDA event (``torch.cuda.Event``, one opened from another process's IPC
    handle too) marking the end of the caller's own GPU work on the blocks (the engine's
    writes, on a stream the handler does not know). The CUDA handler makes its stream wait
    for it on the device (``cudaStreamWaitEvent``: the host does not block) before the
    copy, so the copy sees those writes; it waits for the event's latest ``record`` issued
    before ``submit``. A CPU handler has no stream to order and refuses such a job
    (``CudaUnavailableError``, nothing written). The job holds the event until its result
    is out, so an imported event stays open while the stream may still wait on it; the
    exporting process must keep its own event alive that long too.
    """

    direction: Direction
    block_ids: BlockIds
    chunks: tuple[torch.Tensor, ...]
    skip_blocks: int = 0
    deadline: Deadline | None = None
    after: Any = None


@dataclass(frozen=True)
class TransferResult:
    """What became of one job: the source of offload statistics (bytes, seconds, blocks).

    ``seconds`` is the copy's own time (worker start to end on a CPU, the stream's
    elapsed time between the job's events on a GPU), not the time spent queued. A failed
    job moved no bytes when it failed validation (``blocks`` and ``bytes`` are then 0);
    ``error`` holds the typed error the synchronous API would have raised.
    """

    job_id: int
    direction: Direction
    blocks: int
    bytes: int
    seconds: float
    error: KvcacheError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class CopyPriority(Protocol):
    """Where a CPU handler reports the copying its cache asks for and asks, before each
    piece, whether that copying gives way to other work now (the daemon's
    ``server.copy_share``, one per principal; its pieces then run in the lowest CPU class:
    ``transfer.lowered``)."""

    def charge(self, nbytes: int) -> None:
        """Bytes of copies queued (positive) or done (negative)."""

    def gives_way(self) -> bool:
        """Whether the next piece is copied in the lowest CPU class."""


class TransferHandler(ABC):
    """Moves bytes between one registered engine cache and chunks, asynchronously.

    Thread rules: every method may be called from any thread; ``submit`` and the two
    collectors may run concurrently. No callback ever runs on a copy or driver thread:
    completion is only observed by ``get_finished`` and ``wait``, on the caller's thread.

    Ordering: a job takes effect after every job submitted before it that shares memory
    with it (an engine block past the skip, or a chunk) has finished, so it sees every byte
    they wrote (a retrieve of a chunk just stored reads the stored bytes; of two retrieves into
    one block the later wins). Jobs that share nothing may finish in any order: the CPU handler
    cuts a large job into pieces so that a later small one can pass it; a CUDA handler runs
    them in submission order on its stream. ``get_finished`` reports the finished results
    in submission order.

    Errors: ``submit`` raises only when the handler is closed (``TransferError``). A job
    that fails its checks (block id out of range or not an integer, ids that do not cover
    the chunks, chunks that do not fit the cache) writes nothing and finishes in its
    turn with the error on its result; so does a job past its ``deadline`` and a copy
    that fails while it runs.

    Shutdown: ``close`` stops accepting jobs, then waits until every job already
    submitted has finished (a copy in flight cannot be taken back safely, and a store
    dropped half-way would lose data); their results stay collectable after ``close``.
    """

    @abstractmethod
    def submit(self, job: TransferJob) -> int:
        """Queue ``job``; returns its id (unique per handler, increasing) without waiting."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, in submission order."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        """Block until every job in ``job_ids`` finished or ``timeout`` seconds passed.

        Returns the results of those that finished, in the order of ``job_ids``; a job
        still running is left out and reported by a later call. Raises
        ``UnknownTransferError`` for an id never issued or already reported.
        """

    def wait_any(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        """Block until at least one job in ``job_ids`` finished (or ``timeout`` passed); the
        results of all of them that finished, or none after ``interrupt``. This default
        waits for the first id, which is the same for a handler that finishes jobs in
        submission order."""
        ids = list(job_ids)
        return self.wait(ids[:1], timeout) if ids else []

    def wait_any_in(self, job_ids: Collection[int], timeout: float | None = None) -> list[TransferResult]:
        """``wait_any`` for a caller that keeps its own ids (the engine's completer: every
        job it has in flight): a handler may only ask whether an id is in ``job_ids``, so one
        with many jobs finishing out of order need not walk them all at each result. This
        default walks them once, for ``wait_any``."""
        return self.wait_any(list(job_ids), timeout)

    def interrupt(self) -> None:
        """Make the ``wait_any`` calls in progress return now (a waiter has more ids to wait
        for); a no-op where ``wait_any`` waits for the oldest job anyway."""
        return None

    @abstractmethod
    def drain(self) -> None:
        """Block until every job submitted before the call has finished; their results
        stay to be collected (what ``close`` waits for, without closing)."""

    @abstractmethod
    def close(self) -> None:
        """Refuse new jobs and wait for the submitted ones (idempotent)."""

    def __enter__(self) -> TransferHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BlockIds", "Direction", "TransferHandler", "TransferJob", "TransferResult"]
