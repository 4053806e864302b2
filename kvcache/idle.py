"""The wait of a worker thread that comes with work and goes when idle.

Separate because the CPU transfer handler, the engine's completers and its waiters all run
such a thread (started on the first job, gone after ``idle_exit_s`` without one, so an idle
engine holds no thread), and each must also leave once the interpreter is exiting: a
non-daemon thread that outlived the main thread would keep the process alive. One home for
that rule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sized

IDLE_SLICE_S = 0.1
"""How often an idle thread looks whether it should leave (the main thread may have ended
without anyone notifying its condition)."""


def wait_for_work(
    cv: threading.Condition, queue: Sized, closed: Callable[[], bool], idle_exit_s: float
) -> bool:
    """With ``cv`` held: wait until ``queue`` is not empty (True) or the thread should leave
    (False): its owner closed, ``idle_exit_s`` passed without work, or the main thread ended.
    On False the caller, still holding ``cv``, marks its thread gone and notifies."""
    idle_since = time.monotonic()
    while not len(queue):
        if closed() or time.monotonic() - idle_since >= idle_exit_s or not threading.main_thread().is_alive():
            return False
        cv.wait(IDLE_SLICE_S)
    return True


__all__ = ["IDLE_SLICE_S", "wait_for_work"]
