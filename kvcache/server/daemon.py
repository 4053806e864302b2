"""The daemon's I/O loop: one ZMQ ROUTER, two lanes of worker threads, and a reaper.

The ROUTER listens on a Unix socket (``ipc://``, in a directory only the daemon's user can
enter, peers checked by uid) and on TCP (loopback, or CURVE-authenticated beyond it); a ZAP
handler (``auth``) vets each connection and names its principal, which ZMQ stamps on every
message. Next to it, the fd socket (``fdinbox.FdInbox``) receives the memfds of CPU engines.

Separate from the handlers (what each request does) and the CLI (how the process starts),
so that tests can run a daemon in a thread on an ephemeral port; its settings and their
checks are in ``daemon_config`` (re-exported here).

Threads and ordering:

* the **I/O thread** (whoever calls ``serve``) owns the ROUTER socket: it decodes each frame,
  answers undecodable ones itself, serves the operations that never wait on I/O (ping,
  reports, end session, and lookups unless a remote tier makes them wait on the network)
  inline, because a thread hand-off costs about as much as the lookup itself (``lanes``), and
  queues the rest on a lane, each within its client's in-flight budget (``budget``);
* the **fast lane** (status, remote lookups) and the **bulk lane** (register, unregister,
  store, retrieve) each have their own threads, so a slow store never delays a lookup; the
  lanes share the daemon between principals by the service each used (``fair_queue``): the
  least-served active principal starts first, a busier one waits while it is active, and
  none has more than its share of requests in service, so a backlog is its owner's alone; each
  worker sends its reply back over its own inproc PUSH socket (ZMQ sockets are not
  thread-safe), and the I/O thread forwards it to the client;
* a store or retrieve holds its worker only until its copies are submitted
  (``Handlers.submit``): the reply is sent when the engine's future completes, from the
  engine's completion thread, through the lock-guarded ``deferred.Outbox`` into the same
  reply channel, so no worker waits on a copy and the request stays in flight until then;
* the **reaper** drops instances that sent nothing for ``heartbeat_timeout_s``.

Replies to one client may overtake each other; clients match them by request id.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq

from kvcache.errors import AccessDeniedError
from kvcache.netaddr import is_loopback, unix_socket_live
from kvcache.protocol import messages as m
from kvcache.protocol.channel import NOBLOCK, readable
from kvcache.protocol.codec import DecodeFailure, decode_request, encode_reply
from kvcache.server import auth
from kvcache.server.admission import Admission, Hold, await_left
from kvcache.server.connections import ConnectionGuard
from kvcache.server.copy_share import CopyShares
from kvcache.server.daemon_config import DaemonConfig  # re-exported: built next to Daemon
from kvcache.server.deferred import Outbox
from kvcache.server.delivery import ReplySender
from kvcache.server.fair_queue import FairQueue, FairShare
from kvcache.server.fd_budget import descriptor_limit
from kvcache.server.handlers import Handlers
from kvcache.server.lanes import FORWARD_EVERY_S, InlineShare, lane_of
from kvcache.server.unfinished import CHECK_EVERY_S
from kvcache.transport.curve import load_secret_key
from kvcache.transport.endpoints import fd_socket_path, ipc_endpoint
from kvcache.trusted_dir import ensure_private_dir

log = logging.getLogger("kvcache.server")


_Job = tuple[bytes, int, m.RequestBody, auth.Principal, Hold]
"""A queued request: ROUTER identity, request id, body, sender, and what it holds."""


class Daemon:
    """Serves ``Handlers`` over a ROUTER socket until ``request_stop`` (any thread, signals too)."""

    def __init__(self, config: DaemonConfig, handlers: Handlers) -> None:
        self.config = config
        self.handlers = handlers
        clients = auth.load_clients(config.clients_file) if config.clients_file else []
        self.policy = auth.AccessPolicy(clients)
        self._own_dir = config.runtime_dir is None
        self.runtime_dir = (
            tempfile.mkdtemp(prefix="kvcache-") if config.runtime_dir is None
            else ensure_private_dir(config.runtime_dir, what="runtime directory (--runtime-dir)")
        )  # fmt: skip
        self._ctx = zmq.Context()
        self._zap = auth.ZapHandler(self._ctx, self.policy)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._sender = ReplySender(self._router)  # every reply goes through it, counted when dropped
        self._router.setsockopt(zmq.ZAP_DOMAIN, auth.ZAP_DOMAIN)
        # The frame cap is the message cap: a larger frame drops its connection before
        # libzmq allocates it, so unfinished frames hold at most one cap per connection.
        limits, curve = config.connections.fitted(descriptor_limit()), config.curve_secret_key is not None
        self._guard = ConnectionGuard(limits, curve_tcp=curve, max_message_bytes=config.max_message_bytes)
        self.endpoints: list[str] = []
        self.fd_inbox: Any = None
        try:
            self._guard.attach(self._ctx, self._router)  # before binding: caps set, every connection counted
            if config.listen_ipc:
                self.endpoints.append(self._bind_ipc())
            if config.listen_tcp:
                self.endpoints.append(self._bind_tcp())
                self._guard.gate(self.endpoints[-1])
            self.fd_inbox = self._open_fd_inbox()
        except BaseException:
            self._close_sockets()
            raise
        handlers.fd_inbox = self.fd_inbox
        self.endpoint: str = self.endpoints[-1]
        """The TCP endpoint when there is one, else the ipc:// one."""
        self.ipc_endpoint: str | None = self.endpoints[0] if config.listen_ipc else None
        self._reply_addr = f"inproc://kvcache-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._reply_addr)
        self._outbox = Outbox(self._ctx, self._reply_addr)
        self._stop = threading.Event()
        self._in_flight = 0
        self._admission = Admission(config, handlers)
        share = self._share = FairShare(in_flight=config.fair_in_flight)  # one account, both lanes
        handlers.copies = CopyShares(share)  # a principal copying more than another gives way
        self._lanes: dict[str, FairQueue[_Job]] = {"fast": FairQueue(share), "bulk": FairQueue(share)}
        self._threads: list[threading.Thread] = []
        self._inline_lookups = config.inline_lookups

    def _bind_ipc(self) -> str:
        path = os.path.join(self.runtime_dir, "daemon.sock")
        if unix_socket_live(path):
            raise OSError(
                f"another kvcache daemon listens on ipc://{path}; stop it or pick another --runtime-dir"
            )
        endpoint = ipc_endpoint(self.runtime_dir)
        try:
            self._router.bind(endpoint)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot listen on {endpoint}: {exc}") from None
        os.chmod(path, 0o600)
        return endpoint

    def _bind_tcp(self) -> str:
        config = self.config
        if config.curve_secret_key is not None:
            public, secret = load_secret_key(config.curve_secret_key)
            self._router.setsockopt(zmq.CURVE_SERVER, 1)
            self._router.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self._router.setsockopt(zmq.CURVE_SECRETKEY, secret)
        host = f"[{config.host}]" if ":" in config.host else config.host
        try:
            self._router.bind(f"tcp://{host}:{config.port}")
        except zmq.ZMQError as exc:
            raise OSError(
                f"cannot listen on tcp://{host}:{config.port}: {exc} "
                "(another kvcache daemon on that port? pick one with --port)"
            ) from None
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        if not is_loopback(config.host):
            log.warning("listening on %s: reachable from the network (CURVE required)", endpoint)
        return endpoint

    def _open_fd_inbox(self) -> Any:
        from kvcache.server.fdinbox import FdInbox

        path, uids = fd_socket_path(self.runtime_dir), self.policy.allowed_uids
        inbox = FdInbox(path, uids, on_received=self._guard.descriptors_taken)
        inbox.start()
        return inbox

    def _close_sockets(self, linger: int | None = 0) -> None:
        """Close everything; ``linger=None`` lets queued replies (SHUTTING_DOWN ones included)
        leave for up to the ROUTER's LINGER first."""
        if self.fd_inbox is not None:
            self.fd_inbox.close()
        self._guard.close()
        self._router.close(linger=linger)
        self._zap.close()
        self._ctx.term()
        if self._own_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def request_stop(self) -> None:
        """Stop accepting work; ``serve`` returns once in-flight requests are answered."""
        self._stop.set()

    # -- threads -----------------------------------------------------------------------

    def _start_threads(self) -> None:
        sizes = {"fast": self.config.fast_workers, "bulk": self.config.bulk_workers}
        for lane, count in sizes.items():
            for i in range(count):
                # Daemon threads: a request stuck past the drain timeout must not block exit.
                t = threading.Thread(
                    target=self._work, args=(self._lanes[lane],), name=f"kvcache-{lane}-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)
        reaper = threading.Thread(target=self._reap, name="kvcache-reaper", daemon=True)
        reaper.start()

    def _work(self, lane: FairQueue[_Job]) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, -1)
        push.connect(self._reply_addr)
        try:
            while (got := lane.get()) is not None:
                (identity, request_id, body, principal, hold), slot = got
                awaiting = False  # for another engine's chunks: its bound counts from the read
                if isinstance(body, m.Retrieve) and body.await_chunks:
                    body, awaiting = await_left(body, hold.read_at), True
                pending = self.handlers.submit(body, principal, awaits_held=True)  # never raises
                if pending.done():
                    slot.end()
                    push.send_multipart(self._finish(identity, request_id, hold, pending), copy=False)
                    continue
                if awaiting:
                    slot.end()  # waiting for another's store is not service: never hold a share
                else:  # in service until its copies are done
                    pending.add_done_callback(slot.on_done)
                # copies in flight: answered from the engine's completion thread
                pending.add_done_callback(functools.partial(self._reply_later, identity, request_id, hold))
        finally:
            push.close()

    def _finish(self, identity: bytes, request_id: int, hold: Hold, done: Future[m.ReplyBody]) -> list[bytes]:
        """The reply frames of a finished request, which holds nothing from now on."""
        self._admission.release(hold)
        return [identity, encode_reply(request_id, done.result())]

    def _reply_later(self, identity: bytes, request_id: int, hold: Hold, done: Future[m.ReplyBody]) -> None:
        """Done-callback of a deferred reply; runs on the engine thread that resolved the
        future (an instance's completer, mostly; a waiter or the alarms thread for a store
        that ended waiting), so it only encodes and hands the frames over, never waits."""
        try:
            self._outbox.send(self._finish(identity, request_id, hold, done))
        except Exception:  # a lost reply times out at its client; the completer must go on
            log.exception("could not send the reply of request %d", request_id)

    def _reap(self) -> None:
        period = min(1.0, self.config.heartbeat_timeout_s / 4)
        while not self._stop.wait(period):
            for instance in self.handlers.registry.pop_expired(self.config.heartbeat_timeout_s):
                try:
                    self.handlers.reap(instance)
                except Exception:
                    log.exception("failed to release instance %d", instance.instance_id)

    # -- the loop ----------------------------------------------------------------------

    def serve(self) -> None:
        """Run the I/O loop in the calling thread until stopped and drained."""
        self._start_threads()
        poller = zmq.Poller()
        for sock in (self._router, self._replies, self._guard.monitor_socket):
            poller.register(sock, zmq.POLLIN)
        deadline: float | None = None
        try:
            while True:
                if self._stop.is_set() and deadline is None:
                    deadline = time.monotonic() + self.config.drain_timeout_s
                    self._refuse_queued()
                    log.info("stopping: finishing %d in-flight requests", self._in_flight)
                if deadline is not None and (self._in_flight == 0 or time.monotonic() > deadline):
                    break
                events = dict(poller.poll(100))
                if self._guard.monitor_socket in events:
                    self._guard.pump()
                checking = self._guard.tick()  # then read what waits before judging
                if self._replies in events:
                    self._forward_replies()
                if checking or self._router in events:
                    self._accept(draining=self._stop.is_set())
                if checking:
                    self._guard.cut_unfinished()
                self.handlers.publish_refusals()  # batched: one event per principal and bound
                self._sender.publish_dropped(self.handlers.bus)
        finally:
            self._shutdown_threads(deadline)

    # NOTE: the loops below ask ZMQ_EVENTS whether a message is waiting rather than reading
    # until zmq.Again: an exception per wake-up costs more than the check, on every request.
    def _forward_replies(self) -> None:
        while readable(self._replies):
            frames = self._replies.recv_multipart(NOBLOCK, copy=False)
            self._in_flight -= 1
            self._sender.send(frames)

    def _accept(self, draining: bool) -> None:
        """Read and dispatch what waits on the socket, for ``CHECK_EVERY_S`` at most, stopping
        to forward the workers' replies and yield the processor (``lanes.FORWARD_EVERY_S``):
        every ``FORWARD_EVERY_S`` of reading, and between every two messages while a principal
        other than the last message's sender is active (``FairShare.others_active``)."""
        now = time.monotonic()
        until = now + CHECK_EVERY_S  # a flood must not hold off ``unfinished``'s checks
        forward_at, inline = now + FORWARD_EVERY_S, InlineShare()
        sender: str | None = None  # the principal of the last message read (None: not known)
        first = True
        while readable(self._router) and (now := time.monotonic()) < until:
            if not first and (now >= forward_at or self._share.others_active(sender, now)):
                self._forward_replies()
                os.sched_yield()  # see ``lanes.FORWARD_EVERY_S``
                forward_at = time.monotonic() + FORWARD_EVERY_S
            sender, first = None, False  # until this message names its principal
            # Frames, not bytes: the body frame carries the ZAP User-Id naming the sender.
            frames = self._router.recv_multipart(NOBLOCK, copy=False)
            if not self._guard.admits(frames[-1]):
                continue  # a connection over a cap: being shut down, never served
            identity = frames[0].bytes
            if len(frames) != 2:
                error = m.Error(
                    code=m.ErrorCode.BAD_MESSAGE,
                    message=f"expected one frame per request, got {len(frames) - 1}",
                )
                self._reply_now(identity, 0, error)
                continue
            try:
                envelope = decode_request(frames[1].buffer, self.config.max_message_bytes)
            except DecodeFailure as failure:
                self._reply_now(identity, failure.request_id, failure.error)
                continue
            if draining:
                self._reply_now(identity, envelope.id, _SHUTTING_DOWN)
                continue
            try:
                principal = self.policy.principal(auth.user_id(frames[1]))
                sender = principal.name
            except AccessDeniedError as exc:
                error = m.Error(code=m.ErrorCode.ACCESS_DENIED, message=str(exc))
                self._reply_now(identity, envelope.id, error)
                continue
            body = envelope.body
            instance_id = getattr(body, "instance_id", None)
            lane = inline.lane(principal.name, lane_of(body, self._inline_lookups))
            if lane == "inline":
                with inline.timed(principal.name):
                    reply = self.handlers.handle(body, principal)
                self._sender.send([identity, encode_reply(envelope.id, reply)])
                if isinstance(instance_id, int) and not isinstance(reply, m.Error):
                    self.handlers.registry.touch(instance_id, principal, getattr(body, "token", b""))
                continue
            hold = self._admission.admit(body, principal, len(frames[1]), now)
            if isinstance(hold, m.Error):
                self._reply_now(identity, envelope.id, hold)
                continue
            self._in_flight += 1
            self._lanes[lane].put(principal.name, (identity, envelope.id, body, principal, hold))

    def _refuse_queued(self) -> None:
        """Answer every request still waiting for a worker with ``SHUTTING_DOWN`` at once, so
        its client does not wait out its timeout for a reply that will never come."""
        for lane in self._lanes.values():
            for identity, request_id, _, _, hold in lane.take_all():
                self._in_flight -= 1
                self._admission.release(hold)
                self._reply_now(identity, request_id, _SHUTTING_DOWN)

    def _reply_now(self, identity: bytes, request_id: int, error: m.Error) -> None:
        self._sender.send([identity, encode_reply(request_id, error)])

    def _shutdown_threads(self, deadline: float | None) -> None:
        self._stop.set()
        for q in self._lanes.values():
            q.stop()
        for t in self._threads:
            t.join(None if deadline is None else max(0.1, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("%s still busy after the drain timeout; stopping without it", t.name)
        self._forward_replies()
        self.handlers.publish_refusals()
        self._sender.publish_dropped(self.handlers.bus)
        self._outbox.close()
        self._replies.close(linger=0)
        self._close_sockets(linger=None)


_SHUTTING_DOWN = m.Error(code=m.ErrorCode.SHUTTING_DOWN, message="the daemon is stopping")


__all__ = ["Daemon", "DaemonConfig"]
