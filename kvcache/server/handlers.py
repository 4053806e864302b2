"""One handler per daemon request: decode-free, socket-free calls into the ``CacheEngine``.

Kept apart from the ROUTER loop so that each operation can be read (and tested) as a plain
function of a request Struct, and so that the loop knows nothing about caching. Handlers run
on worker threads; the engine is thread-safe, the registry is locked. Store and retrieve
also come as ``*_async``: they check the request and submit the copies, and their reply is
a future the engine's completion thread resolves (``submit``), so no worker waits on a copy.
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
import numpy as np
import torch

from kvcache.errors import AccessDeniedError, LimitExceededError
from kvcache.futures import resolved, then
from kvcache.protocol import messages as m
from kvcache.protocol.codec import unpack_ids
from kvcache.protocol.errors import error_from_exception
from kvcache.server import ipc
from kvcache.server.auth import LOOPBACK, Principal
from kvcache.server.deadlines import check_deadline, copy_deadline
from kvcache.server.registration import Limits, format_from_name, map_tensors, rebuild_kv_caches
from kvcache.server.registry import Instance, InstanceRegistry

if TYPE_CHECKING:
    from kvcache.engine.engine import CacheEngine
    from kvcache.engine.records import RetrieveResult, StoreResult
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
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.limits = limits if limits is not None else Limits()
        self.fd_inbox = fd_inbox
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
        self._async_table: dict[type, Callable[[Any, Principal], Future[m.ReplyBody]]] = {
            m.Store: self.store_async,
            m.Retrieve: self.retrieve_async,
        }

    def handle(self, body: m.RequestBody, principal: Principal = LOOPBACK) -> m.ReplyBody:
        try:
            return self._table[type(body)](body, principal)
        except Exception as exc:  # every failure becomes a typed reply, never a dead worker
            return _error_reply(exc, body)

    def submit(self, body: m.RequestBody, principal: Principal = LOOPBACK) -> Future[m.ReplyBody]:
        """``handle`` without waiting for copies: a store or retrieve is checked and submitted
        here, and its future resolves on the engine's completion thread once the copies
        finished; every other request is served at once. The future never holds an
        exception (errors become ``Error`` replies, exactly as from ``handle``)."""
        start = self._async_table.get(type(body))
        if start is None:
            return resolved(self.handle(body, principal))
        try:
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
            self._make_room_for(req, principal)
            ctx = self.engine.register(
                req.instance_id,
                req.model_name,
                kv_caches,
                engine=req.engine,
                fmt=fmt,
                block_size=req.block_size,
            )
            device = str(imported[0].tensor.device)
            instance = Instance(
                req.instance_id, req.model_name, device, imported, principal, req.client_nonce
            )
            self.registry.add(instance)
        log.info(
            "registered instance %d (%s) for %s: %s, %d layers x %d blocks of %d tokens on %s",
            req.instance_id, req.model_name, principal.name, ctx.format.name, ctx.num_layers,
            ctx.num_blocks, ctx.block_size, device,
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

    def _make_room_for(self, req: m.Register, principal: Principal) -> None:
        """Refuse a live instance id held by another client; release it if the same client
        registers again (say, after its previous reply was lost). Caller holds the lock."""
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
            return
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
        log.info("instance %d registered again by the same client; replacing it", req.instance_id)
        self._release(req.instance_id)

    def unregister(self, req: m.Unregister, principal: Principal) -> m.ReplyBody:
        self.registry.authorize(req.instance_id, req.token, principal, token_required=True)
        self._release(req.instance_id)
        return m.Done()

    def reap(self, instance: Instance) -> None:
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

    def _instance(self, req: Any, principal: Principal, *, token_required: bool) -> Instance:
        instance = self.registry.authorize(
            req.instance_id, req.token, principal, token_required=token_required
        )
        salt = getattr(req, "cache_salt", None)
        if salt is not None:
            principal.check_salt(salt)
        return instance

    @staticmethod
    def _key_salt(req: m.Lookup | m.LookupItem | m.Store | m.Retrieve, instance: Instance) -> str:
        """The salt the engine keys chunks with: the tenant's ``cache_salt`` and the request's
        ``key_extra``, joined by a separator neither may contain (so no two pairs collide).

        An instance of a ``shared`` principal (plain loopback TCP: any local user) gets a third
        part, its principal's name, which no other request can produce: what it stores is
        never a hit for an engine on another door, and what they store never one for it, or
        any local user could plant KV for the operator's engines or read their prefixes."""
        if _SEP in req.cache_salt or _SEP in req.key_extra:
            raise ValueError("cache_salt and key_extra may not contain \\x1f")
        if instance.principal.shared:
            return f"{req.cache_salt}{_SEP}{req.key_extra}{_SEP}{instance.principal.name}"
        return f"{req.cache_salt}{_SEP}{req.key_extra}" if req.key_extra else req.cache_salt

    def lookup(self, req: m.Lookup, principal: Principal) -> m.ReplyBody:
        instance = self._instance(req, principal, token_required=False)
        hit = self.engine.lookup_tiers(
            req.instance_id,
            self._ids(req.token_ids),
            cache_salt=self._key_salt(req, instance),
            request_id=req.request_id,
        )
        return m.LookupResult(hit_tokens=hit.hit_tokens, l2_hit_tokens=hit.l2_tokens)

    def lookup_batch(self, req: m.LookupBatch, principal: Principal) -> m.ReplyBody:
        """Every item is checked as ``lookup`` checks its request (ids, tenant salt, key
        salt) before the first is served, so a refused batch looked up and prefetched
        nothing. The decoder already bounded the item count (``MAX_LOOKUP_BATCH``)."""
        instance = self._instance(req, principal, token_required=False)
        checked = []
        for item in req.items:
            principal.check_salt(item.cache_salt)
            checked.append((self._ids(item.token_ids), self._key_salt(item, instance), item.request_id))
        hits = self.engine.lookup_many(req.instance_id, checked)
        return m.LookupBatchResult(hits=[m.LookupHit(h.hit_tokens, h.l2_tokens) for h in hits])

    def store(self, req: m.Store, principal: Principal) -> m.ReplyBody:
        return self.store_async(req, principal).result()

    def store_async(self, req: m.Store, principal: Principal) -> Future[m.ReplyBody]:
        """Checks (token, deadline, limits) raise here, before anything is submitted; the
        engine's errors (bad ids, a failed copy, ``copy_by`` passed) arrive on the future.
        Nothing here waits: not for L1 room (the engine's waiter does), nor for the engine's
        GPU work named by ``cuda_event`` (the copies wait for it on the device)."""
        instance = self._instance(req, principal, token_required=True)
        check_deadline(req.deadline_ms, "store")
        token_ids, block_ids = self._ids(req.token_ids), self._ids(req.block_ids)
        if req.block_hashes is not None and len(req.block_hashes) > self.limits.max_ids:
            raise LimitExceededError(f"{len(req.block_hashes)} block hashes exceed --max-ids")
        after = None
        if req.cuda_event is not None:  # CUDA_UNAVAILABLE here on a daemon without a GPU
            after = ipc.open_ipc_event(req.cuda_event, torch.device(instance.device))
        stored = self.engine.store_async(
            req.instance_id,
            token_ids,
            block_ids,
            cache_salt=self._key_salt(req, instance),
            request_id=req.request_id,
            block_hashes=req.block_hashes,
            copy_by=copy_deadline(req.deadline_ms),
            after=after,
        )
        return then(stored, _store_reply)

    def retrieve(self, req: m.Retrieve, principal: Principal) -> m.ReplyBody:
        return self.retrieve_async(req, principal).result()

    def retrieve_async(self, req: m.Retrieve, principal: Principal) -> Future[m.ReplyBody]:
        """As ``store_async``; nothing here waits for L2 loads either (the engine's retrieve
        waiter does). The future resolves once the copy has completed on the host's side, so
        the engine may use the blocks on the reply; no event is exported (it would have to
        outlive the client's wait on it, which the daemon cannot know)."""
        instance = self._instance(req, principal, token_required=True)
        check_deadline(req.deadline_ms, "retrieve")
        got = self.engine.retrieve_async(
            req.instance_id,
            self._ids(req.token_ids),
            self._ids(req.block_ids),
            req.skip_tokens,
            cache_salt=self._key_salt(req, instance),
            request_id=req.request_id,
            copy_by=copy_deadline(req.deadline_ms),
        )
        return then(got, _retrieve_reply)

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

    def _ids(self, ids: m.IdArray) -> np.ndarray:
        """The one place ids from the wire are unpacked, and bounded."""
        count = len(ids.data) // ids.width
        if count > self.limits.max_ids:
            raise LimitExceededError(
                f"{count} ids in one request; the limit is {self.limits.max_ids} (--max-ids)"
            )
        return unpack_ids(ids)


def _error_reply(exc: BaseException, body: m.RequestBody) -> m.Error:
    error = error_from_exception(exc)
    if error.code is m.ErrorCode.INTERNAL:
        log.error("internal error serving %s", type(body).__name__, exc_info=exc)
    return error


def _store_reply(result: StoreResult) -> m.ReplyBody:
    return m.StoreResult(
        stored_chunks=result.stored_chunks,
        skipped_chunks=result.skipped_chunks,
        failed_chunks=result.failed_chunks,
        stored_tokens=result.stored_tokens,
        num_bytes=result.num_bytes,
        transfer_seconds=result.transfer_seconds,
    )


def _retrieve_reply(result: RetrieveResult) -> m.ReplyBody:
    return m.RetrieveResult(
        retrieved_tokens=result.retrieved_tokens,
        num_bytes=result.num_bytes,
        transfer_seconds=result.transfer_seconds,
    )


_SEP = "\x1f"


__all__ = ["Handlers", "Limits"]
