"""The tier's transfer threads: vLLM's ``submit_store`` / ``submit_load`` only queue a job here.

Separate from the tier so the threading can be read (and tested) without vLLM. One thread per
direction, each with its own half of the staging buffer, so a slow store never holds a load
back. A job is a list of (primary chunk, key) pairs done in batches of ``staging_chunks``;
its outcome is a ``Finished`` record the tier turns into vLLM's ``JobResult``. Every job ends
in exactly one record, whatever happens (daemon gone, shutdown, a bug in a copy): vLLM holds
the job's primary chunks until it hears, so a lost record would pin them for good.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("kvcache.integrations.vllm.tier")

Transfer = Callable[[Sequence[int], Sequence[bytes]], int]
"""One batch: (primary chunk ids, keys) -> how many leading ones were done."""


@dataclass(frozen=True, slots=True)
class Job:
    job_id: int
    chunk_ids: Sequence[int]
    keys: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Finished:
    """A job's outcome: ``done`` of its chunks (leading ones, for a load), in ``seconds``."""

    job_id: int
    is_load: bool
    done: int
    total: int
    seconds: float

    @property
    def success(self) -> bool:
        return self.done == self.total


class _Lane:
    """One direction: a queue and the thread that drains it."""

    def __init__(self, name: str, transfer: Transfer, batch: int, is_load: bool, out: deque[Finished],
                 idle: threading.Condition) -> None:  # fmt: skip
        self.transfer, self.batch, self.is_load = transfer, batch, is_load
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.queued = 0  # submitted, not finished (guarded by ``idle``)
        self._out, self._idle = out, idle
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            start = time.monotonic()
            done = 0
            if not self._stopping:
                done = self._do(job)
            self._finish(Finished(job.job_id, self.is_load, done, len(job.keys), time.monotonic() - start))

    def _do(self, job: Job) -> int:
        """Leading chunks done; stops at the first batch not done whole (for a load, what
        follows a missing chunk is of no use to vLLM, which wants a prefix)."""
        done = 0
        try:
            for lo in range(0, len(job.keys), self.batch):
                ids, keys = job.chunk_ids[lo : lo + self.batch], job.keys[lo : lo + self.batch]
                got = self.transfer(ids, keys)
                done += got
                if got < len(keys) or self._stopping:
                    break
        except Exception as err:  # a failed job, never a lost one
            log.debug(
                "kvcache tier: %s job %d failed: %s", "load" if self.is_load else "store", job.job_id, err
            )
        return done

    def _finish(self, result: Finished) -> None:
        with self._idle:
            self._out.append(result)
            self.queued -= 1
            self._idle.notify_all()

    def submit(self, job: Job) -> None:
        with self._idle:
            self.queued += 1
        self.jobs.put(job)

    def stop(self) -> None:
        self._stopping = True
        self.jobs.put(None)


class JobRunner:
    """The two lanes and their finished records. ``submit_*`` never block; ``drain`` waits
    for every submitted job; ``stop`` fails what is queued (its records still appear)."""

    def __init__(self, store: Transfer, load: Transfer, batch: int, max_pending_stores: int) -> None:
        self._idle = threading.Condition()
        self._finished: deque[Finished] = deque()
        self._max_pending_stores = max_pending_stores
        self._stores = _Lane("kvcache-tier-store", store, batch, False, self._finished, self._idle)
        self._loads = _Lane("kvcache-tier-load", load, batch, True, self._finished, self._idle)
        self.refused_stores = 0
        """Store jobs failed at once because ``max_pending_stores`` were queued."""

    def submit_store(self, job: Job) -> None:
        with self._idle:
            full = self._stores.queued >= self._max_pending_stores
            if full:
                self.refused_stores += 1
                self._finished.append(Finished(job.job_id, False, 0, len(job.keys), 0.0))
        if not full:
            self._stores.submit(job)

    def submit_load(self, job: Job) -> None:
        self._loads.submit(job)

    def take_finished(self) -> list[Finished]:
        with self._idle:
            out = list(self._finished)
            self._finished.clear()
        return out

    def busy(self) -> bool:
        with self._idle:
            return bool(self._stores.queued or self._loads.queued or self._finished)

    def drain(self) -> None:
        """Until every submitted job has finished (its record is queued for ``take_finished``)."""
        with self._idle:
            self._idle.wait_for(lambda: not (self._stores.queued or self._loads.queued))

    def stop(self, timeout_s: float) -> None:
        """Fail the queued jobs, let the running ones end, and join the threads."""
        for lane in (self._stores, self._loads):
            lane.stop()
        for lane in (self._stores, self._loads):
            lane.thread.join(timeout_s)


__all__ = ["Finished", "Job", "JobRunner", "Transfer"]
