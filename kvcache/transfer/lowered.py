"""The lowest CPU class for one cache's copies: how a tenant that wants more gives way.

Why a scheduling class and not one more queue: the daemon's lanes decide *which* request
starts (``server/fair_queue.py``), but once a flood's copies run, the kernel shares the core
between their copy thread and every thread serving another tenant. A CPU copy runs native code
with the interpreter lock released, so it is the one part of a flood that truly competes for a
core, for a whole time slice each time. On the noisy-neighbour bench (2-core machine, the
daemon and the victim on one core) a store flood's copies took the victim's L1-hit p99 to
3.2x to 3.9x its unflooded p99; lowered here, 1.1x to 2.5x, within 2x in five runs of six
(docs/benchmarks.md, "Seventh pass").

``SCHED_IDLE`` (Linux): within its scheduling group (the daemon's cgroup or autogroup) the
thread runs when no other thread of the group wants the core, with the least weight the
scheduler has, and another that wakes takes the core from it at once. Entering it needs no
privilege; leaving it does, so the lowered thread is one of its own, kept for the lowered
copies. And it is native: a lowered *Python* thread (the first version) ran Python between
its copies, and one preempted while holding the interpreter lock left every thread of the
daemon waiting for it while it waited for a core a busy process never left (100 to 400 ms
stalls, measured with a normal-priority process on the daemon's core). The native thread
never takes that lock, and no Python thread waits for it while holding it: the cache's own
worker does all the Python and waits (lock released) while the lowered thread copies, and
the copier's construction and destruction never wait for the lowered thread.
"""

from __future__ import annotations

from kvcache import _native
from kvcache.transfer.validate import CheckedJob


class LoweredCopy:
    """A ``CopyFn``: the native copy on a native thread in the lowest CPU class
    (``_native.LoweredCopier``: ``SCHED_IDLE``, else nice 19), the calling worker blocked
    with the interpreter lock released until it is done. The thread starts on the first
    copy and lives as long as this object (one per cache)."""

    def __init__(self) -> None:
        self._copier: _native.LoweredCopier | None = None

    @property
    def copier(self) -> _native.LoweredCopier:
        if self._copier is None:
            self._copier = _native.LoweredCopier()
        return self._copier

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.copier.copy(table, *job.native_args(), num_threads)


__all__ = ["LoweredCopy"]
