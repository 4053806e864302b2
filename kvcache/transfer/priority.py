"""The lowest CPU priority for the calling thread: how a tenant's copies give way to others.

Why a scheduling class and not one more queue: the daemon already decides *which* request
starts (``server/fair_queue.py``), but once a flood's copies run, the kernel shares the core
between their copy thread and every thread serving another tenant. A CPU copy runs native code
with the interpreter lock released, so it is the one part of a flood that truly competes for
the core, for a whole time slice each time. On the noisy-neighbour bench (2-core machine, the
daemon and the victim on one core) a store flood's copies took the victim's L1-hit p99 to
2.5x to 3.9x its unflooded p99, and its lookups' to 2.3x to 6.5x; with them lowered, 1.9x to
2.5x and 1.1x to 2.3x (docs/benchmarks.md, "Seventh pass").

``SCHED_IDLE`` (Linux): the thread runs only on a core no other thread wants, with the least
weight the scheduler has, and any other thread that wakes takes the core from it at once. It
costs the thread nothing while the core is free. Entering it needs no privilege; leaving it
does (``RLIMIT_NICE`` or ``CAP_SYS_NICE``), so a thread that is lowered stays lowered: the CPU
handler keeps a second worker for the copies that give way rather than moving one worker
between classes. Where ``SCHED_IDLE`` is missing the thread takes nice 19, and where neither
can be set it runs as it is (the copies still complete; only the priority is lost).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def lower_this_thread() -> str:
    """Put the calling thread in the lowest CPU class it can enter; says which it got
    (``"idle"``, ``"nice"``, or ``"none"``). On Linux, pid 0 names the calling thread."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError) as exc:
        log.debug("SCHED_IDLE refused for this thread (%s); trying nice 19", exc)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return "nice"
    except (AttributeError, OSError) as exc:
        log.debug("nice 19 refused for this thread too (%s)", exc)
        return "none"


__all__ = ["lower_this_thread"]
