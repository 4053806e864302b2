"""One handler per daemon request: decode-free, socket-free calls into the ``CacheEngine``.

Kept apart from the ROUTER loop so that each operation can be read (and tested) as a plain
function of a request Struct, and so that the loop knows nothing about caching. Handlers run
on worker threads; the engine is thread-safe, the registry is locked. Store and retrieve
also come as ``*_async``: they check the request and submit the copies, and their reply is
a future the engine's completion thread resolves (``submit``), so no worker waits on a copy.
The request is built from the wire message and the instance's registration record alone
(``RegistrationRecord.geometry``), then goes down once into the engine.
What a registration must satisfy before anything is mapped, and the ``Limits`` behind it,
are in ``registration`` (``Limits`` is re-exported here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from kvcache.errors import AccessDeniedError, LimitExceededError, PrincipalLimitError
from kvcache.futures import resolved, then
from kvcache.ids import Packed, check_count, checked_packed, unpacked
from kvcache.keys import KeyScope
from kvcache.observability.event import Event, EventSink, EventType, NullEventBus, RequestRefused
from kvcache.protocol import messages as m
from kvcache.protocol.codec import whole_ids
from kvcache.protocol.errors import error_from_exception
from kvcache.request import RetrieveRequest, StoreRequest
from kvcache.server.auth import LOOPBACK, Principal
from kvcache.server.await_bounds import AwaitBounds
from kvcache.server.budget import give_each, take_each
from kvcache.server.copy_share import CopyShares
from kvcache.server.deadlines import accept_deadline
from kvcache.server.pages import PageHandlers
from kvcache.server.refusals import RefusalTally
from kvcache.server.registration import Limits, format_from_name, map_tensors, rebuild_kv_caches
from kvcache.server.registry import InstanceRegistry, RegistrationRecord
from kvcache.transport.cuda_events import open_ipc_event

if TYPE_CHECKING:
    from kvcache.engine.engine import CacheEngine
    from kvcache.server.fdinbox import FdInbox

log = logging.getLogger("kvcache.server")


class Handlers:
    """Serves decoded requests; ``handle`` never raises (errors become ``Error`` replies).

    Every handler is a function of (request, principal): the principal is who ZMQ says sent
    it, and the registry decides what that principal may do with the instance it names.
    """

    def __init__(
        self,
        engine: CacheEngine,
        registry: InstanceRegistry,
        heartbeat_timeout_s: float,
        *,
        limits: Limits | None = None,
        fd_inbox: FdInbox | None = None,
        bus: EventSink | None = None,
    ) -> None:
        self.engine = engine
        self.bus: EventSink = bus if bus is not None else NullEventBus()
        """Where the daemon's own facts go (``REQUEST_REFUSED``); the engine has its own."""
        self.registry = registry
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.limits = limits if limits is not None else Limits()
        self._refusals = RefusalTally()
        self.awaits = AwaitBounds(self.limits, self._refusals)
        """What awaiting retrieves hold; the daemon's I/O thread takes it at read (``hold``)."""
        self.fd_inbox = fd_inbox
        self.copies: CopyShares | None = None
        """Which principals' copies give way (the daemon's, on its lanes' accounts)."""
        self.started = time.monotonic()
        self._register_lock = threading.Lock()  # a check-then-replace of one instance id
        self._table: dict[type, Callable[[Any, Principal], m.ReplyBody]] = {
            m.Register: self.register,
            m.Unregister: self.unregister,
            m.Lookup: self.lookup,
            m.LookupBatch: self.lookup_batch,
            m.Store: self.store,
            m.Retrieve: self.retrieve,
            m.ReportBlockAllocations: self.report_block_allocations,
            m.EndSession: self.end_session,
            m.Status: self.status,
            m.Ping: self.ping,
        }
        self._async_table: dict[type, Callable[[Any, Principal], Future[Any]]] = {
            m.Store: self.store_async,
            m.Retrieve: self.retrieve_async,
        }
        pages = PageHandlers(self)  # SGLang HiCache pages (``server/pages.py``)
        self._table.update(pages.table())
        self._async_table.update(pages.async_table())

    def handle(self, body: m.RequestBody, principal: Principal = LOOPBACK) -> m.ReplyBody:
        try:
            return self._table[type(body)](body, principal)
        except Exception as exc:  # every failure becomes a typed reply, never a dead worker
            return _error_reply(exc, body)

    def submit(
        self, body: m.RequestBody, principal: Principal = LOOPBACK, *, awaits_held: bool = False
    ) -> Future[m.ReplyBody]:
        """``handle`` without waiting for copies: a store or retrieve is checked and submitted
        here, and its future resolves on the engine's completion thread once the copies
        finished; every other request is served at once. The future never holds an
        exception (errors become ``Error`` replies, exactly as from ``handle``).
        ``awaits_held``: the caller took an awaiting retrieve's bounds (``awaits.hold``)."""
        start = self._async_table.get(type(body))
        if start is None:
            return resolved(self.handle(body, principal))
        try:
            if awaits_held and isinstance(body, m.Retrieve):
                pending: Future[Any] = self.retrieve_async(body, principal, awaits_held=True)
            else:
                pending = start(body, principal)
        except Exception as exc:  # refused before submit: nothing was copied
            return resolved(_error_reply(exc, body))
        return then(pending, lambda reply: reply, lambda exc: _error_reply(exc, body))

    # -- registration ------------------------------------------------------------------

    def register(self, req: m.Register, principal: Principal) -> m.ReplyBody:
        # The hand-over is taken first, so a refused registration frees its slot of the fd
        # socket's quota at once instead of holding it until the ticket expires.
        received = self.fd_inbox.take(req.fd_ticket) if req.fd_ticket and self.fd_inbox else None
        imported = map_tensors(req, principal, received, self.limits)
        kv_caches = rebuild_kv_caches(req, [t.tensor for t in imported])
        fmt = format_from_name(req.fmt)
        with self._register_lock:
            replacing = self._room_for(req, principal)
            ctx = self.engine.register(
                req.instance_id,
                req.model_name,
                kv_caches,
                engine=req.engine,
                fmt=fmt,
                block_size=req.block_size,
                chunk_size=req.chunk_size,
                replace=replacing,  # only once the new registration passed the engine's checks
                tenant=principal.name,  # each principal's own share of L1
                priority=None if self.copies is None else self.copies.principal(principal.name),
            )
            instance = RegistrationRecord(
                req.instance_id, req.model_name, ctx.geometry, imported, principal, req.client_nonce
            )
            if replacing:  # ``add`` swaps the record, its requests in flight still counted
                log.info("instance %d registered again by the same client; replaced", req.instance_id)
            self.registry.add(instance)
        log.info(
            "registered instance %d (%s) for %s: %s, %d layers x %d blocks of %d tokens on %s",
            req.instance_id, req.model_name, principal.name, ctx.format.name, ctx.num_layers,
            ctx.num_blocks, ctx.block_size, ctx.device,
        )  # fmt: skip
        return m.Registered(
            instance_id=req.instance_id,
            num_layers=ctx.num_layers,
            num_blocks=ctx.num_blocks,
            block_size=ctx.block_size,
            chunk_size=ctx.chunk_size,
            fmt=ctx.format.name,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            token=instance.token,
        )

    def _room_for(self, req: m.Register, principal: Principal) -> bool:
        """Refuse a registration over the limits or naming a live instance id another client
        holds; True when the same client registers that id again (say, after its previous
        reply was lost): the new registration replaces it once checked. Changes nothing.
        Caller holds the lock."""
        existing = self.registry.find(req.instance_id)
        if existing is None:
            if len(self.registry) >= self.limits.max_instances:
                raise LimitExceededError(
                    f"{len(self.registry)} instances are registered; the limit is "
                    f"{self.limits.max_instances} (--max-instances)"
                )
            share = min(self.limits.max_instances_per_client, self.limits.max_instances - 1)
            if not principal.operator and self.registry.count(principal) >= share:
                raise LimitExceededError(
                    f"{principal.name} holds {share} registered instances, its share "
                    "(--max-instances-per-client, and never every --max-instances slot)"
                )
            return False
        same = (
            bool(req.client_nonce)
            and secrets.compare_digest(existing.client_nonce, req.client_nonce)
            and existing.principal.name == principal.name
        )
        if not same:
            raise AccessDeniedError(
                f"instance id {req.instance_id} is registered by another live client; pick "
                "another instance_id (KVCacheClient picks a unique one when none is given)"
            )
        return True

    def unregister(self, req: m.Unregister, principal: Principal) -> m.ReplyBody:
        self.registry.authorize(req.instance_id, req.token, principal, token_required=True)
        self._release(req.instance_id)
        return m.Done()

    def reap(self, instance: RegistrationRecord) -> None:
        """Release an instance the registry already dropped for missing heartbeats."""
        log.warning(
            "instance %d (%s) sent nothing for %.1f s; releasing its registration",
            instance.instance_id, instance.model_name, self.heartbeat_timeout_s,
        )  # fmt: skip
        self._unregister_engine(instance.instance_id)

    def _release(self, instance_id: int) -> None:
        self.registry.remove(instance_id)
        self._unregister_engine(instance_id)

    def _unregister_engine(self, instance_id: int) -> None:
        with contextlib.suppress(KeyError):  # the engine never accepted it (a failed register)
            self.engine.unregister(instance_id)

    # -- data path ---------------------------------------------------------------------

    def _instance(self, req: Any, principal: Principal, *, token_required: bool) -> RegistrationRecord:
        instance = self.registry.authorize(
            req.instance_id, req.token, principal, token_required=token_required
        )
        salt = getattr(req, "cache_salt", None)
        if salt is not None:
            principal.check_salt(salt)
        return instance

    def lookup(self, req: m.Lookup, principal: Principal) -> m.ReplyBody:
        instance = self._instance(req, principal, token_required=False)
        scope = KeyScope(req.cache_salt, req.key_extra, instance.door)
        check_count(req.token_ids, self.limits.max_ids)
        hit = self.engine.lookup_tiers(
            req.instance_id, unpacked(req.token_ids), key_scope=scope, request_id=req.request_id
        )
        return m.LookupResult(hit_tokens=hit.hit_tokens, l2_hit_tokens=hit.l2_hit_tokens)

    def lookup_batch(self, req: m.LookupBatch, principal: Principal) -> m.ReplyBody:
        """Every item is checked as ``lookup`` checks its request (ids, tenant salt, key
        salt) before the first is served, so a refused batch looked up and prefetched
        nothing. The decoder already bounded the item count (``MAX_LOOKUP_BATCH``)."""
        instance = self._instance(req, principal, token_required=False)
        scopes: dict[tuple[str, str], KeyScope] = {}  # a step's requests mostly share one
        checked: list[tuple[Packed, KeyScope, str]] = []
        max_ids = self.limits.max_ids
        for item, ids in zip(req.items, whole_ids(req.items, max_ids), strict=True):
            scope = scopes.get((item.cache_salt, item.key_extra))
            if scope is None:
                principal.check_salt(item.cache_salt)
                scope = scopes[item.cache_salt, item.key_extra] = KeyScope(
                    item.cache_salt, item.key_extra, instance.door
                )
            checked.append((checked_packed(ids, max_ids), scope, item.request_id))
        hits = self.engine.lookup_many(req.instance_id, checked)
        return m.LookupBatchResult(hits=hits)

    def store(self, req: m.Store, principal: Principal) -> m.ReplyBody:
        return self.store_async(req, principal).result()

    def store_async(self, req: m.Store, principal: Principal) -> Future[m.StoreResult]:
        """Build the engine's request from the message and the instance's registration
        (every check: token, deadline, limits, ids; they raise here, before anything is
        submitted) and submit it; the engine's errors (a failed copy, the deadline passed)
        arrive on the future, whose result is the reply. Nothing here waits: not for L1 room
        (the engine's waiter does), nor for the engine's GPU work named by ``cuda_event``
        (the copies wait for it on the device)."""
        instance = self._instance(req, principal, token_required=True)
        deadline = accept_deadline(req.deadline_ms, "store")
        scope = KeyScope(req.cache_salt, req.key_extra, instance.door)
        after = None
        if req.cuda_event is not None:  # CUDA_UNAVAILABLE here on a daemon without a GPU
            after = open_ipc_event(req.cuda_event, instance.geometry.device)
        request = StoreRequest.build(
            req.instance_id, instance.geometry, req.token_ids, req.block_ids,
            scope=scope, request_id=req.request_id, deadline=deadline, after=after,
            block_hashes=req.block_hashes, max_ids=self.limits.max_ids,
        )  # fmt: skip
        return self.engine.submit_store(request)

    def retrieve(self, req: m.Retrieve, principal: Principal) -> m.ReplyBody:
        return self.retrieve_async(req, principal).result()

    def retrieve_async(
        self, req: m.Retrieve, principal: Principal, *, awaits_held: bool = False
    ) -> Future[m.RetrieveResult]:
        """As ``store_async``; nothing here waits for L2 loads either (the engine's retrieve
        waiter does). The future resolves once the copy has completed on the host's side, so
        the engine may use the blocks on the reply; no event is exported (it would have to
        outlive the client's wait on it, which the daemon cannot know)."""
        instance = self._instance(req, principal, token_required=True)
        deadline = accept_deadline(req.deadline_ms, "retrieve")
        scope = KeyScope(req.cache_salt, req.key_extra, instance.door)
        takes = () if awaits_held else self.awaits.takes(req)
        if takes:  # counted before its ids are unpacked: a refusal costs no build
            try:
                take_each(principal.name, takes)
            except PrincipalLimitError as exc:
                self.refused(principal.name, exc.flag, "retrieve")
                raise
        try:
            request = RetrieveRequest.build(
                req.instance_id, instance.geometry, req.token_ids, req.block_ids, req.skip_tokens,
                scope=scope, request_id=req.request_id, deadline=deadline, max_ids=self.limits.max_ids,
                await_chunks=req.await_chunks, await_s=req.await_ms / 1000,
            )  # fmt: skip
            future = self.engine.submit_retrieve(request)
        except BaseException:
            give_each(principal.name, takes)
            raise
        if takes:
            future.add_done_callback(lambda _f: give_each(principal.name, takes))
        return future

    def refused(self, principal: str, flag: str, request: str) -> None:
        """Count that ``principal``'s ``request`` was refused at the bound ``flag``; published
        as ``REQUEST_REFUSED`` by ``publish_refusals``, batched."""
        self._refusals.add(principal, flag, request)

    def publish_refusals(self) -> None:
        """Publish the refusals counted since the last call, one event per (principal, flag,
        request) with its count: a flood of refusals costs the event bus one event per batch,
        not one per request (each woke its dispatcher). The daemon's loop calls it each turn."""
        for (principal, flag, request), count in self._refusals.take():
            meta = RequestRefused(principal=principal, limit=flag, request=request, count=count)
            self.bus.publish(Event(EventType.REQUEST_REFUSED, meta))

    def report_block_allocations(self, req: m.ReportBlockAllocations, principal: Principal) -> m.ReplyBody:
        self._instance(req, principal, token_required=False)
        self.engine.report_block_allocations(req.instance_id, req.records)
        return m.Done()

    def end_session(self, req: m.EndSession, principal: Principal) -> m.ReplyBody:
        self._instance(req, principal, token_required=False)
        self.engine.end_session(req.instance_id, req.request_id)
        return m.Done()

    # -- health ------------------------------------------------------------------------

    def status(self, req: m.Status, principal: Principal) -> m.ReplyBody:
        """Daemon health for anyone who may connect; usage only as far as it is the caller's.

        The operator (the daemon's own user) sees the whole cache: every instance, L1 and L2
        usage, all requests in flight. Anyone else sees its own instances and requests and
        the chunk size, nothing that moves with another tenant's traffic (L1/L2 fill, chunk
        counts, waiters), which would tell it what others are doing."""
        mine = self.registry.ids(principal)
        engine_status = self.engine.status()
        engine_status["instances"] = [
            info for info in engine_status["instances"] if info["instance_id"] in mine
        ]
        if not principal.operator:
            engine_status = {k: engine_status[k] for k in ("chunk_size", "instances")}
        return m.StatusResult(
            protocol_version=m.PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
            instances=mine,
            engine=msgspec.to_builtins(engine_status, enc_hook=str, str_keys=True),
            in_flight=self.registry.in_flight(principal),
        )

    def ping(self, req: m.Ping, principal: Principal) -> m.ReplyBody:
        registered = req.instance_id is not None and self.registry.touch(
            req.instance_id, principal, req.token
        )
        fd_socket = self.fd_inbox.path if self.fd_inbox is not None else ""
        return m.Pong(protocol_version=m.PROTOCOL_VERSION, registered=registered, fd_socket=fd_socket)


def _error_reply(exc: BaseException, body: m.RequestBody) -> m.Error:
    error = error_from_exception(exc)
    if error.code is m.ErrorCode.INTERNAL:
        log.error("internal error serving %s", type(body).__name__, exc_info=exc)
    return error


__all__ = ["Handlers", "Limits"]
