"""Bounding the daemon's connections: how many, per client, for how long, and how large a frame.

Why the daemon counts connections itself: libzmq accepts every connection its listeners see,
has no option to cap them, and aborts the whole process when an ``ipc://`` accept meets
``EMFILE`` (it asserts in ``ipc_listener.cpp``); a thousand idle TCP connections to the
loopback port used to be enough. And it allocates a frame's whole buffer when the frame's
header announces it, so each connection may hold one frame cap of memory while the frame
trickles in (or never finishes).

What ``connection_limits.ConnectionLimits`` sets, and how the daemon enforces it:

* ``max_connections`` TCP connections in total (Unix-socket ones are bounded per uid and by
  the descriptor reserve, so the network can never lock the daemon's own user out of its
  Unix socket) and ``max_connections_per_client``: a socket monitor on the
  ROUTER reports every accepted connection with its descriptor (``EVENT_ACCEPTED``) and
  every closed one (``EVENT_DISCONNECTED``). ``ConnectionGuard`` counts them on the daemon's
  I/O thread and, when a new one is over a cap, shuts that connection down (``shutdown(2)``
  on its descriptor; libzmq then sees the peer gone and closes it through its own
  bookkeeping). So the newest connection is the one refused: established engines are never
  dropped for a newcomer. The I/O loop asks the guard about each request's connection (the
  frame's ``ZMQ_SRCFD``) before it reads the request, and the guard first reads every event
  libzmq has queued, so a refused connection never has a request served, however fast it
  speaks: libzmq queues a connection's ACCEPTED before its engine reads a byte (the daemon
  runs one libzmq I/O thread). A guard on a thread of its own, as before, let a peer's first
  requests through while that thread waited for the interpreter lock on a busy daemon.
  While a new TCP connection would be refused anyway, the TCP listener is also shut at the
  kernel (``tcpgate``), so a flood stops before libzmq instead of outrunning the guard. The
  client is named from the transport, before any handshake: ``uid:N`` on the Unix socket
  (``SO_PEERCRED``, the same principal the ZAP handler names), ``loopback`` on plain
  loopback TCP, and the peer's address (``ip:ADDR``) on CURVE TCP, whose key is known
  only after the handshake;
* the descriptor soft limit is raised to the hard one at start (``raise_descriptor_limit``),
  the total cap is clamped to half of what the limit leaves after ``DESCRIPTOR_HEADROOM``, and
  a new connection is also refused while fewer than ``DESCRIPTOR_HEADROOM`` descriptors are
  free, so libzmq never meets ``EMFILE``;
* ``handshake_timeout_s`` (``ZMQ_HANDSHAKE_IVL``) closes connections that never finish the
  ZMTP handshake, and ``peer_heartbeat_s`` (``ZMQ_HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) closes
  those whose peer stops answering pings, so dead or idle peers give their slot back;
* the frame cap (``ZMQ_MAXMSGSIZE``) equals the message cap: a frame announced larger makes
  libzmq drop the connection at once, before it allocates anything. Memory held by unfinished
  frames is therefore at most ``max_connections`` frames of ``max_message_bytes`` over TCP,
  plus ``max_connections_per_client`` of them on the Unix socket (its one uid): libzmq fills
  a frame's buffer inside its I/O thread, where no byte accounting can reach, so the
  connection count is the lever;
* a TCP connection that keeps sending frames of a message that never ends (libzmq holds them
  all, unseen, until the last one) is shut down once it received more than one message cap
  since its last request (``unfinished.UnfinishedMessages``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvcache.protocol.channel import readable
from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM, FreeEstimate, descriptor_limit
from kvcache.server.tcpgate import TcpGate, find_listener
from kvcache.server.unfinished import UnfinishedMessages

log = logging.getLogger("kvcache.server")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_LOG_EVERY_S = 10.0
_GATE_EVERY_S = 1.0  # how often an idle guard looks again at the descriptors left
_COUNT_EVERY_S = 0.25  # how long a count of the open descriptors is trusted


@dataclass(slots=True)
class _Conn:
    client: str
    admitted: bool
    network: bool  # a TCP connection: counts toward ``max_connections``
    endpoint: str


class ConnectionGuard:
    """Counts the ROUTER's connections from its monitor and refuses those over a cap.

    Lives on the daemon's I/O thread, which owns the ROUTER: the loop polls ``monitor_socket`` and
    calls ``pump`` when it is readable, ``tick`` on every turn, and ``admits`` for each
    request before reading it. ``attach`` before the ROUTER binds, so that no connection goes
    uncounted; ``close`` before the ROUTER closes."""

    def __init__(self, limits: ConnectionLimits, curve_tcp: bool, max_message_bytes: int) -> None:
        self.limits = limits
        self._curve_tcp = curve_tcp
        self._conns: dict[int, _Conn] = {}
        self._refused: set[int] = set()  # descriptors whose last connection was refused
        self._per_client: dict[str, int] = {}
        self._admitted = 0
        self._monitor: zmq.Socket[Any] | None = None
        self._router: zmq.Socket[Any] | None = None
        self._last_log = 0.0
        self._unlogged = 0
        self._gate: TcpGate | None = None
        self._last_gate = 0.0
        self._free = FreeEstimate(_COUNT_EVERY_S)
        self._unfinished = UnfinishedMessages(max_message_bytes)

    @property
    def monitor_socket(self) -> zmq.Socket[Any]:
        """The monitor socket, for the I/O loop's poller (after ``attach``)."""
        assert self._monitor is not None, "attach first"
        return self._monitor

    def attach(self, ctx: zmq.Context[Any], router: zmq.Socket[Any]) -> None:
        """Set the caps on ``router`` and watch its connections (before it binds)."""
        self.limits.apply(router, self._unfinished.max_message_bytes)
        address = f"inproc://kvcache-connections-{id(self)}"
        router.monitor(address, _EVENTS)
        monitor = ctx.socket(zmq.PAIR)
        # Unbounded: a lost DISCONNECTED would leak a slot for good (the events are tiny,
        # and as many as the connections libzmq accepts faster than the I/O loop reads).
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        self._router, self._monitor = router, monitor

    def gate(self, tcp_endpoint: str) -> None:
        """Shut the TCP listener of ``tcp_endpoint`` at the kernel whenever the daemon is
        full (after the ROUTER bound it); without one found, surplus connections are only
        shut down one by one."""
        fd = find_listener(tcp_endpoint)
        if fd is None:
            log.warning("cannot find the listener of %s: floods are refused one by one", tcp_endpoint)
            return
        self._gate = TcpGate(fd)

    def close(self) -> None:
        """Stop watching (before the ROUTER closes)."""
        if self._router is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._gate is not None:
            self._gate.close()

    # -- on the I/O thread -------------------------------------------------------------

    def descriptors_taken(self) -> None:
        """Something else took descriptors (any thread): count them afresh before the next
        connection is let into the reserve (``fd_budget.FreeEstimate.stale``)."""
        self._free.stale()

    def admits(self, frame: zmq.Frame) -> bool:
        """Whether the request in ``frame`` came on a connection the caps admitted.

        A descriptor not seen yet is a connection whose ACCEPTED is still queued (libzmq
        queues it before the connection's engine reads a byte): read the queue first. One
        still unknown then closed before its ACCEPTED was read; its request is served unless
        the last connection on that descriptor was refused. A descriptor known as refused is
        read afresh the same way before its request is dropped."""
        fd = frame.get(zmq.SRCFD)
        conn = self._conns.get(fd)
        if conn is None or not conn.admitted:
            # Refused, or so it seems: a refused connection's DISCONNECTED, and the ACCEPTED of
            # a newer one on its reused descriptor, may still be queued, and the newer one's
            # request must not be dropped as the old one's (seen once in a full test run).
            self.pump()
            conn = self._conns.get(fd)
            if conn is None:
                return fd not in self._refused
        if conn.admitted:
            self._unfinished.delivered(fd)
        return conn.admitted

    def pump(self) -> None:
        """Act on every event queued on the monitor, then set the TCP gate."""
        assert self._monitor is not None
        # Read everything there is before acting: a descriptor whose DISCONNECTED is
        # already queued may have been reused by a newer connection.
        batch = []
        while readable(self._monitor):
            batch.append(self._monitor.recv_multipart(zmq.NOBLOCK))
        events = [_parse(frames) for frames in batch]
        for kind, fd, endpoint, closed in _with_fates(events):
            try:  # on the I/O thread: nothing here may end the loop that serves everyone
                if kind == zmq.EVENT_ACCEPTED:
                    self._accepted(fd, endpoint, closed)
                elif kind == zmq.EVENT_DISCONNECTED:
                    self._disconnected(fd)
            except Exception:
                log.exception("could not account for connection event %d on descriptor %d", kind, fd)
        if batch:
            self._set_gate()

    @property
    def watched(self) -> list[int]:
        """The descriptors of the TCP connections watched for messages that never end."""
        return self._unfinished.fds

    def tick(self) -> bool:
        """On every turn of the I/O loop: once a second, set the TCP gate again
        (descriptors may have been freed elsewhere). True when a check for messages that
        never end has begun: the loop then reads every request waiting, and calls
        ``cut_unfinished`` (``unfinished.UnfinishedMessages``)."""
        now = time.monotonic()
        if now - self._last_gate >= _GATE_EVERY_S:
            self._set_gate()
        if not self._unfinished.due():
            return False
        self.pump()  # a descriptor closed since is no longer checked (it may be reused)
        self._each_unfinished(self._unfinished.snapshot, self._unfinished.fds)
        return True

    def cut_unfinished(self) -> None:
        """Shut down the TCP connections that received more than a message since their
        last request (after ``tick`` began the check and the loop read what was waiting)."""

        def judge(fd: int, sock: socket.socket) -> None:
            reason = self._unfinished.over(fd, sock)
            if reason is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                conn = self._conns[fd]
                log.warning("cut a connection from %s on %s: %s", conn.client, conn.endpoint, reason)

        self.pump()  # connections closed during the read: their descriptors may be reused
        self._each_unfinished(judge, self._unfinished.to_judge)

    def _each_unfinished(self, act: Callable[[int, socket.socket], None], fds: list[int]) -> None:
        for fd in fds:
            conn = self._conns.get(fd)
            sock = None if conn is None else _borrow(fd, conn.endpoint)
            if conn is None or sock is None:
                self._unfinished.forget(fd)
                continue
            try:
                act(fd, sock)
            finally:
                sock.detach()

    def _set_gate(self) -> None:
        """Shut the TCP gate while a new TCP connection would be refused anyway: every
        slot taken, plain loopback TCP at its cap, or descriptors running short."""
        self._last_gate = time.monotonic()
        if self._gate is None or not (self._gate.shut or self._conns):
            return
        limits = self.limits
        full = self._admitted >= limits.max_connections or (
            not self._curve_tcp and self._per_client.get("loopback", 0) >= limits.max_connections_per_client
        )
        if not full:
            free = self._free.free()
            full = free is not None and free < 2 * DESCRIPTOR_HEADROOM
        self._gate.set(full)

    def _accepted(self, fd: int, endpoint: str, closed: bool) -> None:
        """Count a new connection, or refuse it when over a cap: shut it down, unless
        ``closed`` (its DISCONNECTED is already in hand, so the descriptor may be another's
        by now); a refused connection's requests are dropped either way."""
        self._disconnected(fd)  # a stale entry for a reused descriptor would hold a slot
        self._refused.discard(fd)
        self._free.accepted()
        sock = _borrow(fd, endpoint)
        if sock is None:  # already closed and reused by something else: nothing to count
            return
        try:
            try:
                client = self._client(sock)
            except OSError:  # closed (libzmq's thread) since it was borrowed: nothing to count
                return
            network = sock.family != socket.AF_UNIX
            reason = self._over_cap(client, network)
            self._conns[fd] = _Conn(client, admitted=reason is None, network=network, endpoint=endpoint)
            if reason is None:
                if network:
                    self._unfinished.watch(fd, sock)
                self._admitted += network
                self._per_client[client] = self._per_client.get(client, 0) + 1
                return
            if not closed:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._refuse(client, endpoint, reason)
        finally:
            sock.detach()

    def _disconnected(self, fd: int) -> None:
        self._unfinished.forget(fd)
        conn = self._conns.pop(fd, None)
        if conn is None:
            return
        if not conn.admitted:  # its requests still queued in libzmq stay refused
            self._refused.add(fd)
            return
        self._admitted -= conn.network
        left = self._per_client[conn.client] - 1
        if left:
            self._per_client[conn.client] = left
        else:
            del self._per_client[conn.client]

    def _client(self, sock: socket.socket) -> str:
        if sock.family == socket.AF_UNIX:
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            return f"uid:{uid}"
        if not self._curve_tcp:
            return "loopback"
        try:
            return f"ip:{sock.getpeername()[0]}"
        except OSError:
            return "ip:?"

    def _over_cap(self, client: str, network: bool) -> str | None:
        """Why a new connection of ``client`` is refused, or None. The total cap counts TCP
        connections only: the Unix socket admits the daemon's own uid alone (its 0700
        directory and ZAP), bounded per uid and by the descriptor reserve, so peers on the
        network, authenticated or not, can never lock the operator's engines out of it."""
        limits = self.limits
        total = self._admitted
        mine = self._per_client.get(client, 0)
        if network and total >= limits.max_connections:
            return f"{total} TCP connections open (--max-connections {limits.max_connections})"
        if mine >= limits.max_connections_per_client:
            return (
                f"{client} has {mine} connections open "
                f"(--max-connections-per-client {limits.max_connections_per_client})"
            )
        free = self._free.free()
        if free is not None and free < DESCRIPTOR_HEADROOM:
            return f"only {free} descriptors left (ulimit -n {descriptor_limit()})"
        return None

    def _refuse(self, client: str, endpoint: str, reason: str) -> None:
        """Log the first refusal, then at most one summary per ``_LOG_EVERY_S``."""
        now = time.monotonic()
        if now - self._last_log < _LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last report)" if self._unlogged else ""
        log.warning("refused a connection from %s on %s: %s%s", client, endpoint, reason, more)
        self._last_log, self._unlogged = now, 0


def _with_fates(events: list[tuple[int, int, str]]) -> list[tuple[int, int, str, bool]]:
    """The events with, for each, whether a later one in the batch closes its descriptor
    (then its descriptor may already belong to another connection: never shut it down)."""
    out: list[tuple[int, int, str, bool]] = []
    closing: set[int] = set()
    for kind, fd, endpoint in reversed(events):
        out.append((kind, fd, endpoint, fd in closing))
        if kind == zmq.EVENT_DISCONNECTED:
            closing.add(fd)
        elif kind == zmq.EVENT_ACCEPTED:
            closing.discard(fd)
    out.reverse()
    return out


def _parse(frames: list[bytes]) -> tuple[int, int, str]:
    """(event, value, endpoint) of a monitor message; the value of ACCEPTED and
    DISCONNECTED is the connection's descriptor."""
    kind, value = struct.unpack("=HI", frames[0][:6])
    return kind, value, frames[1].decode(errors="replace")


def _borrow(fd: int, endpoint: str) -> socket.socket | None:
    """A socket object over ``fd`` (``detach`` it, never close it: libzmq owns the
    descriptor), or None unless ``fd`` is still a connection accepted on ``endpoint``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        local = sock.getsockname()
        if endpoint.startswith("ipc://"):
            same = local == endpoint[len("ipc://") :]
        else:
            port = int(endpoint.rsplit(":", 1)[1])
            same = sock.family in (socket.AF_INET, socket.AF_INET6) and local[1] == port
    except (OSError, ValueError, IndexError):
        same = False
    if not same:
        sock.detach()
        return None
    return sock


__all__ = ["ConnectionGuard", "ConnectionLimits"]
