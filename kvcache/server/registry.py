"""Which engine instances the daemon serves, when each was last heard from, and what is in flight.

Separate from the handlers so that the I/O thread (which stamps arrivals), the workers (which
run requests) and the reaper (which drops silent instances) share one small lock-protected
table and nothing else.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field

from kvcache.errors import AccessDeniedError, UnknownInstanceError
from kvcache.geometry import Geometry
from kvcache.server.auth import Principal
from kvcache.transport.tensors import ImportedTensor


@dataclass(slots=True)
class RegistrationRecord:
    """The daemon's record of one registration; ``tensors`` keep its mapped KV memory alive.
    (The engine's own state of the instance is ``engine.instance.InstanceState``.)

    It holds what the daemon checks a request against, fixed at registration, so a request
    is built from its wire message and this record alone, without asking the engine:
    ``geometry`` (the engine context's, with ``device``, where the mapped tensors live and a
    store's CUDA event is opened) and ``door`` (whose chunks its requests name).
    ``token`` is the secret the registration returned; ``client_nonce`` identifies the client
    object that registered (so it alone may replace the registration); ``principal`` is the
    peer that registered (a ``Principal.name``) and ``cache_salts`` what that peer may use.
    ``in_flight`` counts the requests ``InstanceRegistry.begin`` marked for it, and
    ``generation`` says on which registration of the id they were counted (``add`` sets it).
    """

    instance_id: int
    model_name: str
    geometry: Geometry
    tensors: list[ImportedTensor]
    principal: Principal = field(default_factory=lambda: Principal("loopback"))
    client_nonce: bytes = b""
    token: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    last_seen: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    generation: int = 0

    @property
    def door(self) -> str | None:
        """The ``KeyScope.door`` of this instance's requests: its principal's name when that
        principal is *shared* (plain loopback TCP: any local user), which no other request
        can produce, so what it stores is never a hit for an engine on another door and what
        they store never one for it (or any local user could plant KV for the operator's
        engines, or read their prefixes); None otherwise."""
        return self.principal.name if self.principal.shared else None


class InstanceRegistry:
    """Thread-safe table of registered instances.

    ``begin``/``end`` bracket each request naming an instance, so the reaper never removes
    an instance while a request for it (say, the store of a client that just died) still runs.
    A request's ``end`` names the generation its ``begin`` returned: it lowers the count of
    that registration only, never that of one registered under the same id after an
    unregister or a reap (whose own requests would go uncounted: the reaper could drop it
    while they run).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[int, RegistrationRecord] = {}
        self._generations = itertools.count(1)

    def add(self, instance: RegistrationRecord) -> RegistrationRecord | None:
        """Insert ``instance``; returns the record it replaced (same id registered again by
        the same client), whose requests in flight it takes over with its generation. An id
        free again gets a new generation."""
        with self._lock:
            old = self._instances.get(instance.instance_id)
            if old is not None:
                instance.in_flight, instance.generation = old.in_flight, old.generation
            else:
                instance.generation = next(self._generations)
            self._instances[instance.instance_id] = instance
            return old

    def find(self, instance_id: int) -> RegistrationRecord | None:
        with self._lock:
            return self._instances.get(instance_id)

    def get(self, instance_id: int) -> RegistrationRecord:
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise UnknownInstanceError(
                f"instance {instance_id} is not registered with this daemon "
                "(never registered, unregistered, or reaped after missing heartbeats)"
            )
        return instance

    def authorize(
        self, instance_id: int, token: bytes, principal: Principal, *, token_required: bool
    ) -> RegistrationRecord:
        """The instance, if ``principal`` may act for it; raises otherwise.

        Only the principal that registered an instance may act for it, token or not: a token
        that leaks (a log line, a core dump) is useless to anyone else. Operations that move
        bytes or change the registration need the registration token too. Metadata operations
        (lookup, block reports, end of request, heartbeat) may come without it from a
        principal that identifies its peer: a vLLM scheduler looks up the instance its worker
        registered, in another process that never saw the token. A ``shared`` principal (plain
        loopback TCP: any local user) identifies nobody, so it always needs the token.
        """
        instance = self.get(instance_id)
        if principal.name != instance.principal.name:
            raise AccessDeniedError(
                f"instance {instance_id} was registered by another client; only that client may act for it"
            )
        if token:
            if not secrets.compare_digest(token, instance.token):
                raise AccessDeniedError(
                    f"wrong registration token for instance {instance_id}: only the client "
                    "that registered it may use it"
                )
            return instance
        if token_required or principal.shared:
            why = " (every local user shares this TCP endpoint)" if principal.shared else ""
            raise AccessDeniedError(f"instance {instance_id}: this request needs the registration token{why}")
        return instance

    def __len__(self) -> int:
        with self._lock:
            return len(self._instances)

    def __contains__(self, instance_id: object) -> bool:
        with self._lock:
            return instance_id in self._instances

    def count(self, principal: Principal) -> int:
        """Instances registered by ``principal`` (its share of ``--max-instances``)."""
        with self._lock:
            return sum(inst.principal.name == principal.name for inst in self._instances.values())

    def ids(self, principal: Principal | None = None) -> list[int]:
        """Registered ids; only those ``principal`` may see when one is given (``visible``):
        a client learns nothing of other tenants' instances."""
        with self._lock:
            return sorted(
                i for i, inst in self._instances.items() if principal is None or _visible(inst, principal)
            )

    def in_flight(self, principal: Principal | None = None) -> int:
        """Requests in flight; only for the instances ``principal`` may see when one is given."""
        with self._lock:
            return sum(
                inst.in_flight
                for inst in self._instances.values()
                if principal is None or _visible(inst, principal)
            )

    def remove(self, instance_id: int) -> RegistrationRecord | None:
        with self._lock:
            return self._instances.pop(instance_id, None)

    def touch(
        self, instance_id: int, principal: Principal, token: bytes = b"", now: float | None = None
    ) -> bool:
        """Record that the instance was heard from; False (and nothing recorded) if it is not
        registered or ``principal`` may not speak for it (see ``may_act``)."""
        with self._lock:
            instance = self._instances.get(instance_id)
            if instance is None or not _may_act(instance, principal, token):
                return False
            instance.last_seen = time.monotonic() if now is None else now
            return True

    def begin(
        self, instance_id: int, principal: Principal, token: bytes = b"", now: float | None = None
    ) -> int | None:
        """Mark a request for the instance in flight (the reaper waits for it) and return the
        generation its ``end`` names (never 0); None, and nothing marked, if ``principal`` may
        not speak for it. Only a request that began may ``end``: a stranger naming an
        instance must not keep it alive."""
        with self._lock:
            instance = self._instances.get(instance_id)
            if instance is None or not _may_act(instance, principal, token):
                return None
            instance.in_flight += 1
            instance.last_seen = time.monotonic() if now is None else now
            return instance.generation

    def end(self, instance_id: int, generation: int, now: float | None = None) -> None:
        """A request that ``begin`` marked (it returned ``generation``) ended; nothing to do
        if that registration is gone (unregistered, reaped), even if the id is registered again."""
        with self._lock:
            instance = self._instances.get(instance_id)
            if instance is not None and instance.generation == generation and instance.in_flight > 0:
                instance.in_flight -= 1
                instance.last_seen = time.monotonic() if now is None else now

    def pop_expired(self, timeout_s: float, now: float | None = None) -> list[RegistrationRecord]:
        """Remove and return instances silent for ``timeout_s`` with nothing in flight."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [
                inst
                for inst in self._instances.values()
                if inst.in_flight == 0 and now - inst.last_seen > timeout_s
            ]
            for inst in dead:
                del self._instances[inst.instance_id]
        return dead


def _may_act(instance: RegistrationRecord, principal: Principal, token: bytes) -> bool:
    """The lenient rule of ``authorize`` (metadata operations), as a yes/no: the principal
    that registered, with the right token or, unless it is ``shared``, none."""
    if principal.name != instance.principal.name:
        return False
    if token:
        return secrets.compare_digest(token, instance.token)
    return not principal.shared


def _visible(instance: RegistrationRecord, principal: Principal) -> bool:
    """Whether ``Status`` shows ``instance`` to ``principal``: the operator sees every one,
    a ``shared`` principal none (it proves no identity), any other its own."""
    if principal.operator:
        return True
    return not principal.shared and principal.name == instance.principal.name


__all__ = ["InstanceRegistry", "RegistrationRecord"]
