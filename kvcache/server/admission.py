"""What a request the I/O thread read holds of its principal's bounds until its reply.

Apart from the loop (``daemon``) because it is one rule about accounting, not about sockets:
everything a queued or running request holds is taken here as it is read, in one place, and
given back in one place at its reply, so no bound is counted at read for some requests and at
the worker for others. An awaiting retrieve's bounds were once taken by the worker: a flood
read faster than the workers submit was all below the bound at read, and 2,929 of 5,000 were
refused later, one build, hop and deferred reply each, whose replies held the I/O thread for
0.5 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvcache.errors import PrincipalLimitError
from kvcache.protocol import messages as m
from kvcache.protocol.errors import error_from_exception
from kvcache.server.auth import Principal
from kvcache.server.budget import (
    REQUEST_FLOOR,
    Takes,
    give_each,
    in_flight_bytes,
    in_flight_requests,
    take_each,
)
from kvcache.server.daemon_config import DaemonConfig
from kvcache.server.handlers import Handlers


@dataclass(frozen=True, slots=True)
class Hold:
    """What a request read and not yet answered holds until its reply: one of its
    principal's in-flight requests, its bytes of the in-flight budget and, for an awaiting
    retrieve, its await bounds (``takes``), and the registration that counts it in flight
    (``pinned``: instance id and generation, ``InstanceRegistry.begin``)."""

    principal: str
    takes: Takes
    pinned: tuple[int, int] | None
    read_at: float
    """When the I/O thread read it (``time.monotonic``): an await's bound counts from here."""


class Admission:
    """Takes (``admit``) and gives back (``release``) what each request holds; thread-safe
    (the I/O thread admits, workers and engine threads release)."""

    def __init__(self, config: DaemonConfig, handlers: Handlers) -> None:
        self.handlers = handlers
        self._budget = in_flight_bytes(config.max_in_flight_bytes)  # per client (``budget``)
        self._requests = in_flight_requests(config.max_in_flight_requests)

    def admit(self, body: m.RequestBody, principal: Principal, size: int, read_at: float) -> Hold | m.Error:
        """What ``body`` (``size`` bytes on the wire) holds from now on, or the ``LIMIT``
        reply of the first of its principal's bounds it would cross (counted as refused)."""
        awaits = self.handlers.awaits.hold(body, principal.name)
        if isinstance(awaits, m.Error):  # past a count bound: no worker, no queue, no build
            return awaits
        takes = ((self._requests, 1), (self._budget, max(size, REQUEST_FLOOR)), *awaits)
        try:  # a client reading faster than it is served must not grow the daemon
            take_each(principal.name, takes[:2])
        except PrincipalLimitError as exc:
            give_each(principal.name, awaits)
            self.handlers.refused(principal.name, exc.flag, str(body.__struct_config__.tag))
            return error_from_exception(exc)
        pinned = None  # only a request that may speak for the instance keeps it alive
        instance_id = getattr(body, "instance_id", None)
        if isinstance(instance_id, int):
            generation = self.handlers.registry.begin(instance_id, principal, getattr(body, "token", b""))
            pinned = None if generation is None else (instance_id, generation)
        return Hold(principal.name, takes, pinned, read_at)

    def release(self, hold: Hold) -> None:
        give_each(hold.principal, hold.takes)
        if hold.pinned is not None:
            self.handlers.registry.end(*hold.pinned)


def await_left(body: m.Retrieve, read_at: float) -> m.Retrieve:
    """``body`` with what is left of its await bound: the bound counts from when the daemon
    read the request, not from when a worker took it, so time queued behind other work is
    not added to the client's wait (an await flood's last replies came 1.5 s past the bound)."""
    queued_ms = int((time.monotonic() - read_at) * 1000)
    return msgspec.structs.replace(body, await_ms=max(0, body.await_ms - queued_ms))


__all__ = ["Admission", "Hold", "await_left"]
