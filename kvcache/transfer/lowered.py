"""The lowest CPU class for one cache's copies: how a tenant that wants more gives way.

Why a scheduling class and not one more queue: the daemon's lanes decide *which* request
starts (``server/fair_queue.py``), but once a flood's copies run, the kernel shares the core
between their copy thread and every thread serving another tenant. A CPU copy runs native code
with the interpreter lock released, so it is the one part of a flood that truly competes for a
core, for a whole time slice each time. On the noisy-neighbour bench (2-core machine, the
daemon and the victim on one core) a store flood's copies took the victim's L1-hit p99 to
2.4x to 3.5x its unflooded p99; lowered here, 1.2x to 1.7x (docs/benchmarks.md, "Seventh
pass").

``SCHED_IDLE`` (Linux): the thread runs on a core no other thread wants, with the least weight
the scheduler has, and any other thread that wakes takes the core from it at once; it costs
nothing while the core is free. Entering it needs no privilege; leaving it does, so the
lowered thread is one of its own, kept for the lowered copies. And it is native: a lowered
*Python* thread (the first version) ran Python between its copies, and one preempted while
holding the interpreter lock left every thread of the daemon waiting for it, while it waited
for a core a busy process never left: 100 to 400 ms stalls, measured with a normal-priority
process on the daemon's core. The native thread never takes that lock; the cache's own
worker does all the Python and only waits (lock released) while the lowered thread copies.
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
        self.copier.copy(
            table,
            job.block_ids,
            job.chunk_ptrs,
            job.blocks_per_chunk,
            job.last_chunk_blocks,
            job.skip_blocks,
            job.to_chunks,
            num_threads,
        )


__all__ = ["LoweredCopy"]
