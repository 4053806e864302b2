"""What a serving engine imports to use the kvcache daemon: ``KVCacheClient``.

One client serves one engine instance. Calls mirror ``CacheEngine`` (same arguments, same
exceptions), so an engine can switch between the in-process engine and the daemon.

Two DEALER sockets, so that neither kind of call waits for the other:

* synchronous calls use the caller's socket under a lock: send, then wait for the reply with
  the same id (stale replies of timed-out calls are dropped). On a timeout the socket is
  thrown away and recreated, so a lost reply never wedges the client (a REQ socket would);
* ``store_async``/``retrieve_async`` and heartbeats go through a background thread with its
  own socket; it resolves ``concurrent.futures.Future`` objects and, if a restarted daemon has
  forgotten this instance, registers it again.

Whom it trusts (issue 20): a daemon of the expected uid only (``daemon_uid``,
``$KVCACHE_DAEMON_UID``, else this process's): its ``ipc://`` directory, the peer of every
connection and the fd socket it hands memfds to are checked (``protocol.peer_check``).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import torch
import zmq

from kvcache.errors import AccessDeniedError, DaemonUnavailableError, ProtocolError, UnknownInstanceError
from kvcache.futures import then
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.protocol.breaker import CircuitBreaker
from kvcache.protocol.channel import Channel
from kvcache.protocol.codec import pack_ids
from kvcache.protocol.errors import exception_from_error
from kvcache.protocol.peer_check import DaemonTrust, expected_daemon_uid
from kvcache.server.auth import default_runtime_dir, ipc_endpoint, load_public_key, load_secret_key
from kvcache.server.ipc import (
    EventKeeper,
    ExportedEvent,
    empty_shared,
    export_tensors,
    flatten_kv_caches,
    record_ipc_event,
    to_shared,
)

log = logging.getLogger("kvcache.client")

R = TypeVar("R", bound=m.Reply)


def default_endpoint(daemon_uid: int | None = None) -> str:
    """The co-located daemon's Unix socket: in ``$KVCACHE_RUNTIME_DIR``, else in
    /tmp/kvcache-UID, UID the daemon's (``expected_daemon_uid``)."""
    return ipc_endpoint(default_runtime_dir(expected_daemon_uid(daemon_uid)))


def curve_sockopts(server_public_key: str, secret_key_file: str) -> dict[int, int | bytes]:
    """DEALER options for a CURVE daemon: its public key (Z85 or a .key file) and this
    client's key pair (a .key_secret file from ``kvcache keys``)."""
    public, secret = load_secret_key(secret_key_file)
    return {
        zmq.CURVE_SERVERKEY: load_public_key(server_public_key),
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }


def _unwrap(reply: m.Reply, expected: type[R]) -> R:
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, m.Error):
        raise exception_from_error(reply)
    raise DaemonUnavailableError(f"unexpected reply {type(reply).__name__}")


class KVCacheClient:
    """The engine-side handle on the daemon for one engine instance.

    Thread-safe: synchronous calls from several threads are serialised on one socket;
    ``*_async`` calls run on the background thread. ``timeout_s`` bounds every call.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        instance_id: int | None = None,
        model_name: str = "model",
        *,
        timeout_s: float = 10.0,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
        daemon_uid: int | None = None,
    ) -> None:
        """``endpoint``: default ``default_endpoint()`` (the local daemon's Unix socket).
        ``instance_id``: default a random id, unique per client (two engines on defaults
        never share one). ``curve_server_key`` / ``curve_secret_key``: for a daemon that
        requires CURVE (the daemon's public key; this client's ``.key_secret`` file).
        ``daemon_uid``: the uid the daemon runs as (default ``$KVCACHE_DAEMON_UID``, else
        this process's); an ``ipc://`` directory, peer or fd socket of another uid is refused
        with ``UntrustedPathError`` (here already, if the directory exists)."""
        self.daemon_uid = expected_daemon_uid(daemon_uid)
        self.endpoint = endpoint if endpoint is not None else default_endpoint(self.daemon_uid)
        self._trust = DaemonTrust(self.endpoint, self.daemon_uid)
        self.instance_id = instance_id if instance_id is not None else secrets.randbelow(1 << 31)
        self.model_name = model_name
        self.timeout_s = timeout_s
        if (curve_server_key is None) != (curve_secret_key is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key")
        self._sockopts = (
            curve_sockopts(curve_server_key, curve_secret_key)
            if curve_server_key is not None and curve_secret_key is not None
            else {}
        )
        self._nonce = secrets.token_bytes(16)  # proves "same client" when re-registering
        self._token = b""  # the daemon's registration token, sent with every instance request
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._peer_check = self._trust.peer_check(self._ctx)  # ipc://: every connection's peer
        if self._peer_check is not None:
            self._sockopts.update(self._peer_check.sockopts)
        self._lock = threading.Lock()
        self._chan = self._channel()
        self._register_msg: _Registration | None = None
        self._kv_caches: Any = None
        self._registered: m.Registered | None = None
        self._device = torch.device("cpu")
        self._events = EventKeeper()  # CUDA: a store's event outlives the daemon's wait on it
        self._jobs: queue.SimpleQueue[tuple[m.RequestBody, Future[Any]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._worker_lock = threading.Lock()
        self._reg_lock = threading.Lock()
        self._reg_generation = 0  # registrations done by this client; see _register_again
        self.breaker = CircuitBreaker(probe_interval_s=min(1.0, timeout_s))
        """Open after a call timed out: calls fail at once until a background probe answers."""
        self.dropped_notices = 0
        """Block reports and end-of-request notices dropped (daemon down, or too many queued)."""

    # -- plumbing ----------------------------------------------------------------------

    def _channel(self) -> Channel:
        check = self._peer_check
        return Channel(self._ctx, self.endpoint, self._sockopts, (lambda: check.refusal) if check else None)

    def _call(self, body: m.RequestBody, expected: type[R]) -> R:
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        with self._lock:
            reply = self._call_on(self._chan, body)
        return _unwrap(reply, expected)

    def _call_on(self, chan: Channel, body: m.RequestBody) -> m.ReplyBody:
        """One call; if a restarted daemon has forgotten this instance, register again and
        retry once (the tensors are still shared, so nothing is lost but the daemon's L1).

        While the breaker is open the call fails at once, unsent; a timeout opens it."""
        if self.breaker.refuse():
            raise DaemonUnavailableError(
                f"the kvcache daemon at {self.endpoint} did not answer "
                f"{self.breaker.open_for():.1f} s ago; failing fast until it does"
            )
        try:
            return self._call_once(chan, body)
        except DaemonUnavailableError:
            if self.breaker.trip():
                log.warning("kvcache daemon at %s unreachable: failing fast until it answers",
                            self.endpoint)  # fmt: skip
                self._ensure_worker()  # the background thread probes
            raise

    def _call_once(self, chan: Channel, body: m.RequestBody) -> m.ReplyBody:
        generation = self._reg_generation
        reply = chan.call(self._stamped(body), self.timeout_s)
        if (
            isinstance(reply, m.Error)
            and reply.code is m.ErrorCode.ACCESS_DENIED
            and (self._reg_lock.locked() or generation != self._reg_generation)
        ):
            # Sent with the token of a registration another thread was replacing (a daemon
            # restart noticed by the heartbeat): wait for it, then once more with the new one.
            with self._reg_lock:
                pass
            reply = chan.call(self._stamped(body), self.timeout_s)
        if (
            isinstance(reply, m.Error)
            and reply.code is m.ErrorCode.UNKNOWN_INSTANCE
            and self._register_msg is not None
            and not isinstance(body, (m.Register, m.Unregister))
        ):
            if self._register_again(chan, generation):
                log.info("re-registered instance %d after a daemon restart", self.instance_id)
            reply = chan.call(self._stamped(body), self.timeout_s)
        return reply

    def _stamped(self, body: m.RequestBody) -> m.RequestBody:
        """``body`` with the current token and, for byte-moving requests, the moment this
        client stops waiting: the daemon moves no byte after it (the blocks may be reused)."""
        body = self._with_token(body)
        if isinstance(body, (m.Store, m.Retrieve)):
            deadline_ms = int((time.time() + self.timeout_s) * 1000)
            body = msgspec.structs.replace(body, deadline_ms=deadline_ms)
        return body

    def _with_token(self, body: m.RequestBody) -> m.RequestBody:
        """``body`` carrying the current registration token (it changes on re-registration)."""
        if self._token and getattr(body, "instance_id", None) == self.instance_id:
            return msgspec.structs.replace(body, token=self._token)
        return body

    def _register_again(self, chan: Channel, seen_generation: int) -> bool:
        """Re-register unless another thread already did since ``seen_generation`` was read
        (the heartbeat and a call may both notice a restarted daemon; registering twice would
        leave one of them holding a token the daemon already replaced)."""
        with self._reg_lock:
            if self._reg_generation != seen_generation:
                return False
            self._register_on(chan)
            return True

    def _register_on(self, chan: Channel) -> m.Registered:
        """Register (again) on ``chan``: hand the memfds over, then send ``Register``."""
        registration = self._register_msg
        if registration is None:
            raise RuntimeError("register_kv_caches has not been called")
        descs, fds = export_tensors(registration.leaves)  # the memfds, found afresh each time
        ticket = b""
        if fds:
            pong = _unwrap(chan.call(m.Ping(), self.timeout_s), m.Pong)
            if not pong.fd_socket:
                raise DaemonUnavailableError(
                    "the daemon has no fd socket, so it cannot map CPU tensors; CPU engines "
                    "must run on the daemon's host"
                )
            path = self._trust.fd_socket(pong.fd_socket)
            from kvcache.server.fdpass import send_fds

            ticket = secrets.token_bytes(16)
            send_fds(path, ticket, fds, self.timeout_s, peer_uid=self.daemon_uid)
        msg = msgspec.structs.replace(registration.msg, tensors=descs, fd_ticket=ticket)
        reply = _unwrap(chan.call(msg, self.timeout_s), m.Registered)
        self._token, self._registered = reply.token, reply
        self._reg_generation += 1
        return reply

    def _submit(self, body: m.RequestBody) -> Future[Any]:
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        self._ensure_worker()
        future: Future[Any] = Future()
        self._jobs.put((body, future))
        return future

    def _ensure_worker(self) -> None:
        with self._worker_lock:
            if self._worker is None and not self._closed:
                self._worker = threading.Thread(
                    target=self._background, name=f"kvcache-client-{self.instance_id}", daemon=True
                )
                self._worker.start()

    def _background(self) -> None:
        """Runs queued async calls; sends a heartbeat ping whenever it has been idle."""
        chan = self._channel()
        try:
            while True:
                interval = self._heartbeat_interval()
                try:
                    job = self._jobs.get(timeout=interval)
                except queue.Empty:
                    self._heartbeat(chan)
                    continue
                if job is None:
                    return
                body, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(self._call_on(chan, body))
                except BaseException as exc:
                    future.set_exception(exc)
        finally:
            chan.close()

    def _heartbeat_interval(self) -> float:
        if self.breaker.open:
            return self.breaker.probe_interval_s
        reg = self._registered
        return max(reg.heartbeat_timeout_s / 3, 0.05) if reg is not None else 1.0

    def _heartbeat(self, chan: Channel) -> None:
        if self.breaker.open:
            self._probe(chan)
        if self._register_msg is None or self.breaker.open:
            return
        reg = self._registered
        # A beat waits no longer than the daemon's patience, so a restart is noticed quickly.
        wait = min(self.timeout_s, reg.heartbeat_timeout_s) if reg is not None else self.timeout_s
        generation = self._reg_generation
        try:
            pong = chan.call(m.Ping(instance_id=self.instance_id, token=self._token), wait)
        except DaemonUnavailableError as exc:  # the next beat retries; sync calls report it
            log.debug("heartbeat failed: %s", exc)
            return
        except AccessDeniedError as exc:  # a refused or untrusted peer: the thread lives on
            log.warning("heartbeat refused: %s", exc)
            return
        if isinstance(pong, m.Pong) and not pong.registered:
            try:
                if self._register_again(chan, generation):
                    log.info("re-registered instance %d with the daemon", self.instance_id)
            except Exception as exc:
                log.warning("re-registering instance %d failed: %s", self.instance_id, exc)

    def _probe(self, chan: Channel) -> None:
        """Ask the daemon once whether it is back; close the breaker if it answers."""
        try:
            chan.call(m.Ping(), self.breaker.probe_interval_s)
        except (DaemonUnavailableError, AccessDeniedError):
            return
        if self.breaker.close():
            log.info("kvcache daemon at %s answers again", self.endpoint)

    # -- registration ------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: Any,
        engine: str = "vllm",
        block_size: int | None = None,
        fmt: Any = None,
    ) -> m.Registered:
        """Share the engine's KV tensors with the daemon (CPU: sealed memfds, GPU: CUDA IPC).

        ``kv_caches`` is one tensor, a list, or ``[K_list, V_list]``; CPU tensors must come
        from ``empty_shared``. ``fmt`` is a ``GPUKVFormat`` (or its name) when detection
        from shapes is ambiguous.
        """
        leaves, nesting, groups = flatten_kv_caches(kv_caches)
        fmt_name = fmt if isinstance(fmt, str) or fmt is None else fmt.name
        msg = m.Register(
            instance_id=self.instance_id,
            model_name=self.model_name,
            tensors=[],
            nesting=nesting,
            group_sizes=groups,
            engine=engine,
            fmt=fmt_name,
            block_size=block_size,
            client_nonce=self._nonce,
        )
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        with self._lock:
            self._register_msg = _Registration(msg, leaves)
            try:
                with self._reg_lock:
                    reply = self._register_on(self._chan)
            except BaseException:
                self._register_msg = None
                raise
        self._device = leaves[0].device
        # Keep the tensors (and so their memfds) alive for re-registration after a daemon
        # restart, even if the caller drops its own references.
        self._kv_caches = kv_caches
        self._ensure_worker()
        return reply

    def unregister(self) -> None:
        with self._reg_lock:  # not while a re-registration is in flight: its token would win
            msg, self._register_msg = self._register_msg, None
        if msg is not None:
            self._call(m.Unregister(instance_id=self.instance_id), m.Done)  # token: _stamped
            self._token = b""

    # -- data path ---------------------------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], *, cache_salt: str = "", request_id: str = "", key_extra: str = ""
    ) -> int:
        """Leading tokens of ``token_ids`` the cache holds (whole chunks).

        ``key_extra`` (here and in ``store``/``retrieve``): whatever besides the tokens decides
        the KV (a LoRA adapter, multimodal inputs); chunks are keyed by it too."""
        return self.lookup_tiers(
            token_ids, cache_salt=cache_salt, request_id=request_id, key_extra=key_extra
        ).hit_tokens

    def lookup_tiers(
        self, token_ids: Sequence[int], *, cache_salt: str = "", request_id: str = "", key_extra: str = ""
    ) -> m.LookupResult:
        """``lookup``, also saying how many of the hit tokens come from L2."""
        msg = m.Lookup(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            cache_salt=cache_salt,
            request_id=request_id,
            key_extra=key_extra,
        )
        return self._call(msg, m.LookupResult)

    def lookup_batch(self, items: Sequence[m.LookupItem]) -> list[m.LookupHit]:
        """The lookups of several requests (say, every request a scheduler step admits), one
        answer per item in order, in one round trip per ``MAX_LOOKUP_BATCH`` items. Build an
        item with ``m.LookupItem(token_ids=pack_ids(tokens), cache_salt=..., request_id=...,
        key_extra=...)``. One refused item (a salt the tenant may not use, too many ids)
        refuses its whole batch with the error a single ``lookup`` of it would raise."""
        hits: list[m.LookupHit] = []
        for start in range(0, len(items), m.MAX_LOOKUP_BATCH):
            part = list(items[start : start + m.MAX_LOOKUP_BATCH])
            got = self._call(m.LookupBatch(instance_id=self.instance_id, items=part), m.LookupBatchResult)
            if len(got.hits) != len(part):
                raise ProtocolError(
                    f"the daemon answered {len(got.hits)} lookups for a batch of {len(part)}"
                )
            hits += got.hits
        return hits

    def _store_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        cache_salt: str,
        request_id: str,
        block_hashes: Sequence[int] | None,
        key_extra: str = "",
    ) -> tuple[m.Store, ExportedEvent | None]:
        """The message, and the CUDA event its handle names (held until ``_settled``)."""
        exported = record_ipc_event(self._device) if self._device.type == "cuda" else None
        if exported is not None:
            self._events.hold(exported)
        msg = m.Store(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            block_ids=pack_ids(block_ids),
            cache_salt=cache_salt,
            request_id=request_id,
            block_hashes=None if block_hashes is None else list(block_hashes),
            cuda_event=None if exported is None else exported.handle,
            key_extra=key_extra,
        )
        return msg, exported

    def _settled(self, exported: ExportedEvent | None) -> None:
        """The store's reply arrived or the call gave up: the event only lingers now."""
        if exported is not None:
            self._events.release(exported)

    def store(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        key_extra: str = "",
    ) -> m.StoreResult:
        """Copy the engine blocks ``block_ids`` (holding ``token_ids`` in order) into the cache."""
        msg, exported = self._store_msg(
            token_ids, block_ids, cache_salt, request_id, block_hashes, key_extra
        )
        try:
            return self._call(msg, m.StoreResult)
        finally:
            self._settled(exported)

    def store_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        key_extra: str = "",
    ) -> Future[m.StoreResult]:
        msg, exported = self._store_msg(
            token_ids, block_ids, cache_salt, request_id, block_hashes, key_extra
        )
        future = self._chain(self._submit(msg), m.StoreResult)
        future.add_done_callback(lambda _f: self._settled(exported))
        return future

    def _retrieve_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int,
        cache_salt: str,
        request_id: str,
        key_extra: str = "",
    ) -> m.Retrieve:
        return m.Retrieve(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            block_ids=pack_ids(block_ids),
            skip_tokens=skip_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
            key_extra=key_extra,
        )

    def retrieve(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> int:
        """Copy cached chunks into ``block_ids``; returns the valid prefix length in tokens."""
        return self.retrieve_reply(
            token_ids, block_ids, skip_tokens, cache_salt=cache_salt, request_id=request_id,
            key_extra=key_extra,
        ).retrieved_tokens  # fmt: skip

    def retrieve_reply(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> m.RetrieveResult:
        """``retrieve`` with the daemon's whole reply (the copy's bytes and seconds too), on
        the caller's own channel: it never queues behind the asynchronous calls in flight."""
        msg = self._retrieve_msg(token_ids, block_ids, skip_tokens, cache_salt, request_id, key_extra)
        return self._finish_retrieve(self._call(msg, m.RetrieveResult))

    def retrieve_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> Future[int]:
        """``retrieve`` without waiting: the future holds the valid prefix length."""
        reply = self.retrieve_reply_async(
            token_ids, block_ids, skip_tokens, cache_salt=cache_salt, request_id=request_id,
            key_extra=key_extra,
        )  # fmt: skip
        return then(reply, lambda r: r.retrieved_tokens)

    def retrieve_reply_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> Future[m.RetrieveResult]:
        """``retrieve_async`` with the daemon's whole reply: the prefix length and what its
        copies moved (``num_bytes``, ``transfer_seconds``), for offload statistics."""
        msg = self._retrieve_msg(token_ids, block_ids, skip_tokens, cache_salt, request_id, key_extra)
        return then(self._chain(self._submit(msg), m.RetrieveResult), self._finish_retrieve)

    def _finish_retrieve(self, reply: m.RetrieveResult) -> m.RetrieveResult:
        if reply.cuda_event is not None and self._device.type == "cuda":
            # The engine's stream must not touch the blocks before the daemon's copy is done.
            from kvcache.server.ipc import wait_ipc_event

            wait_ipc_event(reply.cuda_event, self._device)
        return reply

    @staticmethod
    def _chain(raw: Future[Any], expected: type[R]) -> Future[R]:
        return then(raw, lambda reply: _unwrap(reply, expected))

    def report_block_allocations(
        self, records: Sequence[BlockAllocationRecord], *, wait: bool = True
    ) -> None:
        """Report a step's block allocations (L0 lifecycle metrics). ``wait=False`` queues it
        on the background thread and returns at once: a scheduler must never block on it."""
        msg = m.ReportBlockAllocations(instance_id=self.instance_id, records=list(records))
        if wait:
            self._call(msg, m.Done)
        else:
            self._notify(msg)

    def end_session(self, request_id: str, *, wait: bool = True) -> None:
        """Tell the daemon a request ended; ``wait=False`` as for ``report_block_allocations``."""
        msg = m.EndSession(instance_id=self.instance_id, request_id=request_id)
        if wait:
            self._call(msg, m.Done)
        else:
            self._notify(msg)

    _MAX_QUEUED_NOTICES = 1024

    def _notify(self, body: m.RequestBody) -> None:
        """Fire and forget: dropped (and counted) while the daemon is down or the queue is long."""
        if self._closed or self.breaker.open or self._jobs.qsize() >= self._MAX_QUEUED_NOTICES:
            self.dropped_notices += 1
            return
        future = self._submit(body)
        future.add_done_callback(self._count_failed_notice)

    def _count_failed_notice(self, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.dropped_notices += 1

    # -- health ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self._call(m.Status(), m.StatusResult))

    def ping(self) -> bool:
        """True if the daemon answers and knows this instance; raises when it does not answer."""
        return self._call(m.Ping(instance_id=self.instance_id), m.Pong).registered

    def close(self, *, unregister: bool = True) -> None:
        """Unregister (best effort) and release the sockets; the tensors stay the caller's."""
        if self._closed:
            return
        if unregister and self._register_msg is not None:
            try:
                self.unregister()
            except (DaemonUnavailableError, UnknownInstanceError) as exc:
                log.debug("unregister on close failed: %s", exc)
        self._closed = True
        self._register_msg = self._kv_caches = None
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=self.timeout_s + 1)
        with self._lock:
            self._chan.close()
        if self._peer_check is not None:
            self._peer_check.close()
        if self._worker is not None and self._worker.is_alive():
            self._ctx.destroy(linger=0)  # term() would wait for the stuck thread's socket
        else:
            self._ctx.term()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class _Registration:
    """What (re-)registration needs: the message without its tensors, and the tensors, whose
    descriptors (and memfds, handed over under a one-shot ticket) are made afresh each time."""

    msg: m.Register
    leaves: list[torch.Tensor]


__all__ = [
    "KVCacheClient",
    "curve_sockopts",
    "default_endpoint",
    "empty_shared",
    "expected_daemon_uid",
    "to_shared",
]
