"""Completion of an instance's copy jobs: one engine thread that waits for their results.

Separate from the data paths because the transfer contract runs no callback on a copy or
driver thread (``TransferHandler``): a result is only observed by a caller's ``wait``. The
store and retrieve paths submit a job and hand its id here with what to do once it finished
(settle the L1 entries, publish the end event, resolve the caller's future); this thread
waits for the results and runs those steps, so the submitting thread never blocks on a copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvcache.errors import KvcacheError, TransferError
from kvcache.idle import wait_for_work
from kvcache.transfer.base import Direction, TransferHandler, TransferResult

logger = logging.getLogger("kvcache.engine.completion")

#: What to run once a job finished; it owns the error handling of its own operation.
OnDone = Callable[[TransferResult], None]


class Completer:
    """Waits for the results of one handler's jobs and runs their ``on_done``, in order.

    Thread rules: ``add``, ``drain`` and ``close`` may be called from any thread; every
    ``on_done`` runs on the completer's own thread, one at a time, in the order the jobs
    finish (``TransferHandler.wait_any``): a small retrieve that the CPU handler let pass a
    large store is completed, and its reply sent, without waiting for the store. An
    ``on_done`` may block (a write-through waiting for room in a
    busy L2 queue): later completions of the same instance wait behind it, which is the
    back-pressure a burst of stores is meant to feel.

    The thread starts on the first ``add`` and leaves after ``idle_exit_s`` without work,
    so an idle instance holds no thread. NOTE: it collects results with ``wait`` on its
    own job ids only; a caller that drains the same handler with ``get_finished`` would
    take those results away (the job's ``on_done`` then gets an ``UnknownTransferError``).
    """

    def __init__(self, handler: TransferHandler, name: str, idle_exit_s: float = 2.0) -> None:
        self._handler = handler
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._queue: dict[int, tuple[Direction, OnDone]] = {}  # added, not yet completed
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, job_id: int, direction: Direction, on_done: OnDone) -> None:
        """Run ``on_done(result)`` on the completer's thread once job ``job_id`` finished."""
        with self._cv:
            if self._closed:
                raise TransferError(f"{self._name}: the completer is closed")
            self._queue[job_id] = (direction, on_done)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=False)
                self._thread.start()
                return
            self._cv.notify_all()
        self._handler.interrupt()  # a thread waiting for the earlier jobs waits for this one too

    def on_own_thread(self) -> bool:
        """True on the completer's thread (in an ``on_done``, or a future's done-callback
        it runs), where waiting for a later completion would wait forever."""
        return self._thread is not None and threading.current_thread() is self._thread

    def drain(self) -> None:
        """Block until every job added before the call has been completed."""
        if self.on_own_thread():
            raise RuntimeError("drain() called from an on_done callback: it would wait for itself")
        with self._cv:
            while self._queue:
                self._cv.wait()

    def close(self) -> None:
        """Refuse new jobs, complete the ones added, and let the thread go (idempotent)."""
        with self._cv:
            self._closed = True
        self.drain()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not wait_for_work(self._cv, self._queue, lambda: self._closed, self._idle_exit_s):
                    self._thread = None
                    self._cv.notify_all()
                    return
            for result in self._finished():
                _, on_done = self._queue[result.job_id]  # only this thread removes an entry
                try:
                    on_done(result)
                except Exception:  # an on_done settles its own future; never lose the thread
                    logger.exception("%s: completing transfer job %d failed", self._name, result.job_id)
                with self._cv:
                    del self._queue[result.job_id]
                    self._cv.notify_all()

    def _finished(self) -> list[TransferResult]:
        """The results of the pending jobs that finished first (none if ``add`` interrupted).
        The handler is handed the queue itself, to ask about the jobs that finished
        (``wait_any_in``): copying or walking every job in flight at each result made a
        flood of stores cost this thread O(n^2) under the GIL. ``add`` only inserts, and a
        dict's membership test is atomic, so the handler may ask while ``add`` runs."""
        try:
            return self._handler.wait_any_in(self._queue)
        except KvcacheError:  # a result was taken by someone else (see NOTE): find which
            pass
        with self._cv:
            job_id, (direction, _) = next(iter(self._queue.items()))
        try:
            return self._handler.wait([job_id])
        except KvcacheError as err:
            return [TransferResult(job_id, direction, 0, 0, 0.0, err)]


__all__ = ["Completer", "OnDone"]
