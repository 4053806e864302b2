"""The daemon's descriptor budget: the limit raised at start, and a reserve kept free.

One home for the numbers that three doors share: the connection guard refuses a connection,
the registration a memfd view, and the fd inbox a hand-over, once fewer than
``DESCRIPTOR_HEADROOM`` descriptors are left, so libzmq never meets ``EMFILE`` (it aborts
the process on an ``ipc://`` accept that does).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time

log = logging.getLogger("kvcache.server")

DESCRIPTOR_HEADROOM = 256
"""Descriptors kept free for everything but connections (ZMQ's own, files, the fd socket,
L2 tiers, the metrics endpoint): a new connection is refused when fewer are free."""


def raise_descriptor_limit() -> int:
    """Raise this process's descriptor soft limit to its hard limit; returns the soft limit.

    Many systems start processes at a soft limit of 1024 while allowing far more; a daemon
    serving many engines should not be held to it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


def descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def free_descriptors() -> int | None:
    """Descriptors this process may still open (None where /proc cannot tell)."""
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    return descriptor_limit() - used


class FreeEstimate:
    """Descriptors left, less every connection accepted since they were last counted.

    Counting lists ``/proc/self/fd``: 2 ms at 5,000 open descriptors (an engine's memfd
    views each keep one), far too long to pay on the I/O thread for each connection of a
    flood. Connections are what arrive fast, and each takes one descriptor (a refused one
    too, until libzmq closes it), so between counts (``every_s``) the estimate only errs low,
    as long as whatever else takes descriptors says so (``stale``)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._counted: int | None = None  # free descriptors at the last count
        self._counted_at = -every_s
        self._accepts = 0

    def accepted(self) -> None:
        self._accepts += 1

    def stale(self) -> None:
        """Descriptors were taken by something else (the fd inbox, any thread): count
        afresh at the next ``free``. A hand-over installs up to a thousand at once, and an
        estimate high by that many would admit connections into the reserve."""
        self._counted_at = -math.inf

    def free(self) -> int | None:
        now = time.monotonic()
        if now - self._counted_at >= self.every_s:
            self._counted, self._counted_at, self._accepts = free_descriptors(), now, 0
        return None if self._counted is None else self._counted - self._accepts


__all__ = [
    "DESCRIPTOR_HEADROOM",
    "FreeEstimate",
    "descriptor_limit",
    "free_descriptors",
    "raise_descriptor_limit",
]
