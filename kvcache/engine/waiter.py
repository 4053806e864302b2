"""The engine's waiters: the threads on which operations wait, off their caller's thread.

Separate from the store and retrieve paths because ``store_async`` and ``retrieve_async`` share one
rule: they never wait on their caller's thread (an engine step, a daemon worker serving every
client). The caller does what needs no waiting; an operation that must wait (a store for L1
room, a retrieve for the L2 -> L1 loads of its prefix) is handed here and waits, within its
own deadline, on a thread the engine owns and closes. The paths supply what to run
(``WaitJob``); this module knows nothing of chunks, only of order and of stopping.

One class, two instances per engine (``EngineParts.store_waiter`` / ``retrieve_waiter``), so
two threads: a store's wait for room blocks its thread inside the L1 pool
(``L1Pool.begin_write``), and a retrieve must not queue behind another instance's store
waiting for room (nor behind its own instance's: a store's ``block_ids`` are the caller's to
keep until its future resolves, and a retrieve reads only chunks already visible, so it has
nothing to wait for there but would inherit up to ``store_wait_timeout_s`` of latency).
Stores keep their per-instance FIFO (``only_behind``); retrieves take no place in any
instance's store order. Each waiter serves the instances in turn, one job each, so no
instance's backlog delays another's by more than one job; and a retrieve pass that waits for
loads serves every waiting retrieve whose chunks settled (``waiting.WaitingRetrieves``), so a
retrieve never waits behind another one's loads. NOTE: a retrieve whose chunks must still be
looked up in L2 (no lookup began them) waits for the passes before it to do that; never for
their waits, though: a pass whose retrieve only waits (for loads, or for chunks another engine
stores: ``await_chunks``, which any client may ask for up to the retrieve wait bound) hands
the thread over to a job that has not run yet (``hand_over``) and runs again after it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache.idle import wait_for_work

logger = logging.getLogger("kvcache.engine.waiter")

#: An operation's waiting part. It runs once and settles its operation itself (never raises
#: on purpose); it waits only while ``stop`` is not set, and takes what is there then.
WaitJob = Callable[[threading.Event], None]


@dataclass(eq=False)
class _Job:
    instance_id: int
    run: WaitJob
    stop: threading.Event = field(default_factory=threading.Event)
    handed: bool = False  # it ran once and handed the thread on (``hand_over``): not fresh


class _RoundRobin:
    """The waiter's queue: per instance, its fresh jobs (FIFO) before its handed-over ones
    (FIFO), the instances served one job each in turn.

    ``pop`` is O(1); ``fresh`` counts the jobs that never ran (``hand_over`` asks it on every
    pass, so it must not scan a backlog). Fresh first: a handed-over job is a retrieve's pass
    that only waits (its op is served by whichever pass runs), so running the handed ones
    first made each new job wait for every handed one to run and hand over again, O(waiting)
    per new await and O(n^2) under an await flood."""

    def __init__(self) -> None:
        # instance id -> (fresh, handed); insertion order: the turn order
        self._by_instance: dict[int, tuple[deque[_Job], deque[_Job]]] = {}
        self._len = 0
        self.fresh = 0

    def __len__(self) -> int:
        return self._len

    def append(self, job: _Job) -> None:
        fresh, handed = self._by_instance.setdefault(job.instance_id, (deque(), deque()))
        (handed if job.handed else fresh).append(job)
        self._len += 1
        self.fresh += not job.handed

    def pop(self) -> _Job:
        """The next instance's oldest fresh job, else its oldest handed one; that instance goes
        to the back of the turn."""
        instance_id = next(iter(self._by_instance))
        fresh, handed = jobs = self._by_instance.pop(instance_id)
        job = fresh.popleft() if fresh else handed.popleft()
        if fresh or handed:
            self._by_instance[instance_id] = jobs  # re-inserted: last in turn
        self._len -= 1
        self.fresh -= not job.handed
        return job

    def take_all(self, instance_id: int | None) -> list[_Job]:
        """Remove and return ``instance_id``'s jobs (every job with None): handed-over ones
        (they ran first) then fresh ones, each oldest first."""
        ids = list(self._by_instance) if instance_id is None else [instance_id]
        out = []
        for i in ids:
            fresh, handed = self._by_instance.pop(i, ((), ()))
            out += [*handed, *fresh]
        self._len -= len(out)
        self.fresh -= sum(not job.handed for job in out)
        return out


class Waiter:
    """Runs operations' waiting parts one at a time: each instance's in the order they were
    handed over, the instances in turn.

    One per kind of operation and engine. The thread starts on the first ``add`` and leaves
    after ``idle_exit_s`` without work (or once the main thread has ended), so an engine whose
    operations never wait holds no thread. One thread; each instance has its own FIFO and the
    thread takes one job from each instance with work in turn (round robin), so an instance
    that queued thousands of jobs (a flood of awaiting retrieves) delays another instance's
    next job by at most one of its own, not by its whole backlog. A running job may give the
    thread to a newer one and queue itself again (``hand_over``).

    Ordering per instance: while an instance has a job queued or running, ``add(...,
    only_behind=True)`` queues its next store too, so a later store cannot take the room an
    earlier one waits for, and an instance's copies are still submitted in call order.

    Stopping: ``cancel`` (an instance leaving) and ``close`` set the jobs' ``stop`` and call
    ``wake`` (what the jobs wait on: the L1 pool's ``wake_writers`` for stores, the engine's
    load signal for retrieves), so a waiting job ends at once, taking what is there; jobs
    still queued then run on the cancelling thread, so it never waits behind another
    instance's wait. After ``close``, ``add`` runs its job at once, stopped.

    Thread rules: every method may be called from any thread, a job's own included (a
    done-callback of an operation the job settled); there ``cancel`` and ``close`` do not wait
    for the job that is running them.
    """

    def __init__(
        self, wake: Callable[[], None], name: str, idle_exit_s: float = 2.0, *, wake_on_add: bool = False
    ) -> None:
        self._wake = wake
        self._wake_on_add = wake_on_add  # a running job may hand over to a new one (``hand_over``)
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._queue = _RoundRobin()
        self._running: _Job | None = None
        self._waiting: Counter[int] = Counter()  # instance id -> its jobs queued or running
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, instance_id: int, run: WaitJob, *, only_behind: bool = False) -> bool:
        """Queue ``run`` for ``instance_id``; True once it is queued (or, after ``close``, ran).

        With ``only_behind`` it is queued only behind a job of the same instance, and False
        (nothing queued) means the instance has none: the caller may go ahead on its own.
        """
        job = _Job(instance_id, run)
        with self._cv:
            if only_behind and not self._waiting[instance_id]:
                return False
            self._waiting[instance_id] += 1
            queued = not self._closed
            if queued:
                self._queue.append(job)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=self._name, daemon=False)
                    self._thread.start()
                else:
                    self._cv.notify_all()
                wake = self._wake_on_add and self._running is not None
        if queued:
            if wake:
                self._wake()  # the running job may hand the thread over to this one
            return True
        job.stop.set()  # closed: take what is free now, on this thread
        self._run(job)
        return True

    def hand_over(self, stop: threading.Event) -> bool:
        """Called by the running job (``stop`` is its own): when a job that never ran waits
        behind it, queue the running job again at the back (with the same ``stop``) and
        return True; it then returns, and runs again after the new one. False when nothing
        new waits, or it was stopped (it then ends here, as always).

        Why: a retrieve may wait long on purpose (``await_chunks``, up to the retrieve wait
        bound), and another client's retrieve must not queue behind that wait. A job that
        ran once never takes the thread from another such job, so they never pass it round
        in circles; ``cancel`` and ``close`` find a handed-over job in the queue as any other."""
        with self._cv:
            job = self._running
            if job is None or job.stop is not stop or stop.is_set() or self._closed:
                return False
            if not self._queue.fresh:
                return False
            job.handed = True
            self._queue.append(job)
            self._waiting[job.instance_id] += 1  # its run now ending takes one off
            return True

    def on_own_thread(self) -> bool:
        """True on the waiter's thread, where waiting for an operation handed here never ends."""
        return self._thread is not None and threading.current_thread() is self._thread

    def cancel(self, instance_id: int | None = None) -> None:
        """Stop the waits of ``instance_id``'s jobs (every job's with None) and return once
        they all ran: each takes what is there now and settles its operation."""
        with self._cv:
            mine = self._queue.take_all(instance_id)
            running = self._running
            if running is not None and instance_id is not None and running.instance_id != instance_id:
                running = None
        if running is not None:
            running.stop.set()
            self._wake()
            if not self.on_own_thread():  # it goes first: its copies were due first
                with self._cv:
                    while self._running is running:
                        self._cv.wait()
        for job in mine:
            job.stop.set()
            self._run(job)

    def close(self) -> None:
        """Stop every wait, run what is queued, and let the thread go (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()  # an idle thread leaves now, not a slice later
        self.cancel()
        if self.on_own_thread():
            return
        with self._cv:
            while self._thread is not None:
                self._cv.wait()

    def _serve(self) -> None:
        while True:
            with self._cv:
                if not wait_for_work(self._cv, self._queue, lambda: self._closed, self._idle_exit_s):
                    self._thread = None
                    self._cv.notify_all()
                    return
                job = self._running = self._queue.pop()
            self._run(job)

    def _run(self, job: _Job) -> None:
        try:
            job.run(job.stop)
        except Exception:  # a job settles its own operation; never lose the thread
            logger.exception("%s: a waiting job of instance %d failed", self._name, job.instance_id)
        finally:
            with self._cv:
                self._waiting[job.instance_id] -= 1
                if not self._waiting[job.instance_id]:
                    del self._waiting[job.instance_id]
                if self._running is job:
                    self._running = None
                self._cv.notify_all()


__all__ = ["WaitJob", "Waiter"]
