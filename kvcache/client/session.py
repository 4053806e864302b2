"""One engine instance's connection to the daemon: sockets, breaker, heartbeat, re-registration.

Split from the data API (``client.api``) because none of this depends on what a request
carries: the API builds messages, the session delivers them and keeps the instance known to
the daemon. Two DEALER sockets, so that neither kind of call waits for the other:

* synchronous calls use the caller's socket under a lock: send, then wait for the reply with
  the same id (stale replies of timed-out calls are dropped). On a timeout the socket is
  thrown away and recreated, so a lost reply never wedges the client (a REQ socket would);
* asynchronous calls and heartbeats go through a background thread (``kvcache-client-<id>``,
  ``client.pipeline``) with its own socket, up to ``window`` calls in flight, replies matched
  by envelope id, each call with its own deadline; it resolves ``concurrent.futures.Future``
  objects and, if a restarted daemon has forgotten this instance, registers it again.

Whom it trusts (issue 20): a daemon of the expected uid only (``daemon_uid``,
``$KVCACHE_DAEMON_UID``, else this process's): its ``ipc://`` directory, the peer of every
connection and the fd socket it hands memfds to are checked (``protocol.peer_check``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq

from kvcache.client.calls import Call
from kvcache.client.hooks import SendHook, hooked
from kvcache.client.pipeline import DEFAULT_WINDOW, Pipeline
from kvcache.errors import DaemonUnavailableError, UnknownInstanceError
from kvcache.futures import then
from kvcache.protocol import messages as m
from kvcache.protocol.breaker import CircuitBreaker
from kvcache.protocol.channel import Channel
from kvcache.protocol.errors import R, unwrap
from kvcache.protocol.peer_check import DaemonTrust, expected_daemon_uid
from kvcache.transport.curve import curve_sockopts
from kvcache.transport.endpoints import default_endpoint
from kvcache.transport.fdpass import send_fds
from kvcache.transport.tensors import export_tensors

log = logging.getLogger("kvcache.client")


@dataclass(frozen=True, slots=True)
class Registration:
    """What (re-)registration needs: the message without its tensors, and the tensors, whose
    descriptors (and memfds, handed over under a one-shot ticket) are made afresh each time."""

    msg: m.Register
    leaves: list[torch.Tensor]


class Session:
    """The delivery half of ``KVCacheClient``, for one engine instance.

    Thread-safe: synchronous calls (``call``) from several threads are serialised on one
    socket; ``submit`` and ``notify`` go to the background thread, sent in order, up to
    ``window`` in flight, answered in any order. ``timeout_s`` bounds every call. While the
    breaker is open calls fail at once, unsent.
    """

    _MAX_QUEUED_NOTICES = 1024

    def __init__(
        self,
        endpoint: str | None,
        instance_id: int,
        *,
        timeout_s: float,
        curve_server_key: str | None,
        curve_secret_key: str | None,
        daemon_uid: int | None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.daemon_uid = expected_daemon_uid(daemon_uid)
        self.endpoint = endpoint if endpoint is not None else default_endpoint(self.daemon_uid)
        self._trust = DaemonTrust(self.endpoint, self.daemon_uid)
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        if (curve_server_key is None) != (curve_secret_key is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key")
        self._sockopts = (
            curve_sockopts(curve_server_key, curve_secret_key)
            if curve_server_key is not None and curve_secret_key is not None
            else {}
        )
        self._token = b""  # the daemon's registration token, sent with every instance request
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._peer_check = self._trust.peer_check(self._ctx)  # ipc://: every connection's peer
        if self._peer_check is not None:
            self._sockopts.update(self._peer_check.sockopts)
        self.breaker = CircuitBreaker(probe_interval_s=min(1.0, timeout_s))
        """Open after a call timed out and the daemon was silent: calls fail at once until a probe answers."""
        self._lock = threading.Lock()
        self._chan = self.channel()
        self._registration: Registration | None = None
        self._registered: m.Registered | None = None
        self._closed = False
        self._reg_lock = threading.Lock()
        self._reg_generation = 0  # registrations done by this session; see _register_again
        self._hooks: list[SendHook] = []
        self._pipeline = Pipeline(self, window)
        self.dropped_notices = 0
        """Block reports and end-of-request notices dropped (daemon down, or too many queued)."""

    @property
    def token(self) -> bytes:
        """The registration token (b"" before registering; a re-registration replaces it), for
        tools that send their own requests for this instance."""
        return self._token

    @property
    def window(self) -> int:
        """Asynchronous calls in flight at most (1: one at a time); may be changed any time."""
        return self._pipeline.window

    @window.setter
    def window(self, value: int) -> None:
        self._pipeline.window = value

    def intercept(self, hook: SendHook) -> None:
        """Route every request the breaker lets through, on any thread, through ``hook``: for
        tests and tools that delay, count or observe requests before they reach the daemon.
        Hooks stack: the latest is outermost. ``send`` returns once the reply is in: for an
        asynchronous call the hook runs on a thread of its own (``kvcache-client-hook-<id>``),
        so a hook holding one call back holds back no other."""
        self._hooks.append(hook)

    # -- calls -------------------------------------------------------------------------

    def call(self, body: m.RequestBody, expected: type[R]) -> R:
        """One synchronous call on the caller's socket; the reply, or its error raised."""
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        with self._lock:
            reply = self._call_on(self._chan, body)
        return unwrap(reply, expected)

    def submit(self, body: m.RequestBody, expected: type[R]) -> Future[R]:
        """One call on the background thread; the future holds the reply or its error."""
        return then(self._submit(body), lambda reply: unwrap(reply, expected))

    def notify(self, body: m.RequestBody) -> None:
        """Fire and forget: dropped (and counted) while the daemon is down or the queue is long."""
        if self._closed or self.breaker.open or self._pipeline.queued() >= self._MAX_QUEUED_NOTICES:
            self.dropped_notices += 1
            return
        self._submit(body, awaited=False).add_done_callback(self._count_failed_notice)

    def _submit(self, body: m.RequestBody, *, awaited: bool = True) -> Future[Any]:
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        if self._hooks:
            return self._pipeline.submit_hooked(body, hooked(self._hooks, self._pipeline.call))
        return self._pipeline.submit(body, awaited=awaited)

    def _count_failed_notice(self, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.dropped_notices += 1

    def channel(self) -> Channel:
        """A new DEALER channel to the daemon (peer-checked, CURVE if configured)."""
        check = self._peer_check
        refusal = (lambda: check.refusal) if check else None
        return Channel(self._ctx, self.endpoint, self._sockopts, refusal, self.breaker.heard, daemon=check)

    def refusal(self) -> DaemonUnavailableError | None:
        """The error of a call refused unsent (the breaker is open), counted; else None."""
        if not self.breaker.refuse():
            return None
        return DaemonUnavailableError(
            f"the kvcache daemon at {self.endpoint} did not answer "
            f"{self.breaker.open_for():.1f} s ago; failing fast until it does"
        )

    def _refuse_if_open(self) -> None:
        if (error := self.refusal()) is not None:
            raise error

    def _call_on(self, chan: Channel, body: m.RequestBody) -> m.ReplyBody:
        """One call; if a restarted daemon has forgotten this instance, register again and
        retry once (the tensors are still shared, so nothing is lost but the daemon's L1).

        While the breaker is open the call fails at once, unsent; a timeout while the daemon
        sent nothing at all (on any socket) opens it."""
        self._refuse_if_open()
        sent_at = time.monotonic()
        try:
            if not self._hooks:
                return self._call_once(chan, body)
            return hooked(self._hooks, lambda b: self._call_once(chan, b))(body)
        except DaemonUnavailableError:
            if self.breaker.silent_since(sent_at):
                self.silent(None)
            raise

    def silent(self, call: Call | None) -> None:
        """A call timed out and the daemon sent nothing meanwhile: open the breaker."""
        if self.breaker.trip():
            log.warning("kvcache daemon at %s unreachable: failing fast until it answers", self.endpoint)
            self._pipeline.ensure_running()  # the background thread probes

    def _call_once(self, chan: Channel, body: m.RequestBody) -> m.ReplyBody:
        generation = self._reg_generation
        reply = chan.call(self._stamped(body), self.timeout_s)
        if not isinstance(reply, m.Error):  # the usual case: no retry to keep track of
            return reply
        call = Call(body, Future(), generation=generation)
        while self._resend(call, reply, chan):
            call.generation = self._reg_generation
            reply = chan.call(self._stamped(body), self.timeout_s)
        return reply

    def resend(self, call: Call, reply: m.ReplyBody) -> bool:
        """For the pipeline: as ``_resend``, re-registering on a channel of its own."""
        return self._resend(call, reply, None)

    def _resend(self, call: Call, reply: m.ReplyBody, chan: Channel | None) -> bool:
        """True if ``call`` must be sent again: its token was being replaced (wait for the
        new one), or a restarted daemon has forgotten this instance (registered again here,
        on ``chan`` or, for ``None``, on a channel of its own); each retry at most once."""
        if not isinstance(reply, m.Error):
            return False
        if (
            reply.code is m.ErrorCode.ACCESS_DENIED
            and "token" not in call.tried
            and (self._reg_lock.locked() or call.generation != self._reg_generation)
        ):
            # Sent with the token of a registration another thread was replacing (a daemon
            # restart noticed by the heartbeat): wait for it, then once more with the new one.
            call.tried.add("token")
            with self._reg_lock:
                pass
            return True
        if (
            reply.code is m.ErrorCode.UNKNOWN_INSTANCE
            and "register" not in call.tried
            and self._registration is not None
            and not isinstance(call.body, (m.Register, m.Unregister))
        ):
            call.tried.add("register")
            own = self.channel() if chan is None else chan
            try:
                if self._register_again(own, call.generation):
                    log.info("re-registered instance %d after a daemon restart", self.instance_id)
            finally:
                if chan is None:
                    own.close()
            return True
        return False

    def stamp(self, body: m.RequestBody) -> tuple[m.RequestBody, int]:
        """For the pipeline: ``body`` as sent now, and the registration it was sent under."""
        return self._stamped(body), self._reg_generation

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

    # -- registration ------------------------------------------------------------------

    def register(self, registration: Registration) -> m.Registered:
        """Register on the caller's socket and keep ``registration`` for re-registering after
        a daemon restart (it holds the tensors, and so their memfds, alive)."""
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        with self._lock:
            self._registration = registration
            try:
                with self._reg_lock:
                    reply = self._register_on(self._chan)
            except BaseException:
                self._registration = None
                raise
        self._pipeline.ensure_running()  # the heartbeat
        return reply

    def unregister(self) -> None:
        with self._reg_lock:  # not while a re-registration is in flight: its token would win
            registration, self._registration = self._registration, None
        if registration is not None:
            self.call(m.Unregister(instance_id=self.instance_id), m.Done)  # token: _stamped
            self._token = b""

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
        registration = self._registration
        if registration is None:
            raise RuntimeError("register_kv_caches has not been called")
        descs, fds = export_tensors(registration.leaves)  # the memfds, found afresh each time
        ticket = b""
        if fds:
            pong = unwrap(chan.call(m.Ping(), self.timeout_s), m.Pong)
            if not pong.fd_socket:
                raise DaemonUnavailableError(
                    "the daemon has no fd socket, so it cannot map CPU tensors; CPU engines "
                    "must run on the daemon's host"
                )
            path = self._trust.fd_socket(pong.fd_socket)
            ticket = secrets.token_bytes(16)
            send_fds(path, ticket, fds, self.timeout_s, peer_uid=self.daemon_uid)
        msg = msgspec.structs.replace(registration.msg, tensors=descs, fd_ticket=ticket)
        reply = unwrap(chan.call(msg, self.timeout_s), m.Registered)
        self._token, self._registered = reply.token, reply
        self._reg_generation += 1
        return reply

    # -- the heartbeat (sent by the pipeline's thread) ----------------------------------

    def heartbeat(self) -> tuple[float, m.RequestBody | None, float]:
        """(interval, the ping to send when nothing was sent for that long, its wait): a
        probe while the breaker is open, a beat while registered, nothing otherwise. A beat
        waits no longer than the daemon's patience, so a restart is noticed quickly."""
        if self.breaker.open:
            return self.breaker.probe_interval_s, m.Ping(), self.breaker.probe_interval_s
        reg = self._registered
        if reg is None or self._registration is None:
            return 1.0, None, self.timeout_s
        ping = m.Ping(instance_id=self.instance_id, token=self._token)
        return max(reg.heartbeat_timeout_s / 3, 0.05), ping, min(self.timeout_s, reg.heartbeat_timeout_s)

    def beat_answered(self, pong: m.ReplyBody, generation: int) -> None:
        """A probe's answer closes the breaker; a beat's says whether the daemon still knows
        this instance (else it is registered again, on a channel of its own)."""
        if self.breaker.open:
            if self.breaker.close():
                log.info("kvcache daemon at %s answers again", self.endpoint)
            return
        if isinstance(pong, m.Pong) and not pong.registered and self._registration is not None:
            chan = self.channel()
            try:
                if self._register_again(chan, generation):
                    log.info("re-registered instance %d with the daemon", self.instance_id)
            except Exception as exc:
                log.warning("re-registering instance %d failed: %s", self.instance_id, exc)
            finally:
                chan.close()

    # -- closing -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, unregister: bool = True) -> None:
        """Unregister (best effort), stop the background thread and release the sockets."""
        if self._closed:
            return
        if unregister and self._registration is not None:
            try:
                self.unregister()
            except (DaemonUnavailableError, UnknownInstanceError) as exc:
                log.debug("unregister on close failed: %s", exc)
        self._closed = True
        self._registration = None
        with self._lock:
            self._chan.close()
        if not self._pipeline.close(self.timeout_s + 1, self._release):
            log.warning("the kvcache client thread is still busy (a callback?): its socket, the "
                        "peer check and the context are released when it ends")  # fmt: skip

    def _release(self) -> None:
        """Stop the ZAP handler and end the context, once every socket is closed: libzmq asks
        the handler about each connection a socket makes, and aborts the process
        (``zap_client.cpp:50``) if a handshake reaches it while it goes."""
        if self._peer_check is not None:
            self._peer_check.close()
        self._ctx.term()


__all__ = ["Registration", "SendHook", "Session", "unwrap"]
