"""Callbacks at set moments, on one engine thread: the bound of a wait that is a callback.

Separate because some waits of the data paths hold no thread: a store that met a chunk an L2
prefetch is still loading watches that load by callback (``store._StoreOp._watch``), and it
must still stop watching at its own deadline, however long the tier takes. One thread per
engine keeps every such bound; it starts with the first alarm and leaves when none is left
for ``idle_exit_s``, like the waiters. It also takes work that must leave an I/O thread at
once (``soon``): the end of a store whose last part was such a load, whose done-callbacks
must not run on the tier's worker. A daemon thread: a pending alarm never keeps the
process alive, and what it would end (a store's watch) dies with the process anyway.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from kvcache.deadline import Deadline

logger = logging.getLogger("kvcache.engine.alarms")


class Alarm:
    """One pending callback; ``cancel`` keeps it from running (it may be running already)
    and lets go of it at once: a cancelled alarm stays queued until its moment, but no
    longer keeps what its callback refers to alive."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class Alarms:
    """Runs each callback once its deadline has passed, in deadline order, off the caller's
    thread. Callbacks must be quick, may run after ``cancel`` (a race), and must not raise.
    After ``close`` every pending callback has run, and ``at`` runs its callback at once."""

    def __init__(self, name: str, idle_exit_s: float = 2.0) -> None:
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._seq = itertools.count()  # ties run in the order they were set
        self._thread: threading.Thread | None = None
        self._closed = False

    def at(self, deadline: Deadline, callback: Callable[[], None]) -> Alarm:
        alarm = Alarm(callback)
        with self._cv:
            if not self._closed:
                heapq.heappush(self._heap, (deadline.at, next(self._seq), alarm))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                    self._thread.start()
                else:
                    self._cv.notify()
                return alarm
        _run(alarm)
        return alarm

    def soon(self, callback: Callable[[], None]) -> Alarm:
        """``callback`` on this thread as soon as it is free: for work that must leave the
        thread it is on (an I/O thread's callback) with no wait of any kind ahead of it."""
        return self.at(Deadline(0.0), callback)

    def on_own_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Run every pending callback now, on this thread, and let the thread go."""
        with self._cv:
            self._closed = True
            due, self._heap = self._heap, []
            self._cv.notify()
        for _, _, alarm in sorted(due):
            _run(alarm)

    def _serve(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        alarm = heapq.heappop(self._heap)[2]
                        break
                    if not self._heap and (self._closed or now - idle_since >= self._idle_exit_s):
                        self._thread = None
                        return
                    wait = self._heap[0][0] - now if self._heap else self._idle_exit_s - (now - idle_since)
                    self._cv.wait(wait)
            _run(alarm)
            idle_since = time.monotonic()


def _run(alarm: Alarm) -> None:
    callback = alarm.callback
    if callback is None:
        return
    try:
        callback()
    except Exception:  # one broken callback must not cost the others their call
        logger.exception("an alarm's callback failed")


__all__ = ["Alarm", "Alarms"]
