"""The client end of the daemon protocol: send one request, wait for its reply, or time out.

Separate from ``KVCacheClient`` (which knows what to ask) so that the socket discipline, the
one part that must survive a daemon restart, can be read on its own.

libzmq never reconnects a channel's socket (``NEVER_MS``): each socket makes one connection,
and when it ends the channel opens a fresh socket itself (``RECONNECT_S``), after reading the
replies that came before the end. On ``ipc://`` every socket is ZAP-checked (``peer_check``),
and libzmq (4.3.5) keeps one ZAP pipe per connecting session across its own reconnections: a
connection dropped while its ZAP request was pending, answered only after the session had
connected again, had the answer handed to the new connection's engine, which had no security
mechanism yet, and libzmq aborted the process (``_mechanism != NULL``,
``stream_engine_base.cpp:487``). A peer at the endpoint decides when to drop; the answer is
late whenever the client's process stalls (a full garbage collection). With one connection
per socket, a late answer meets only its own engine or none.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvcache.errors import (
    AccessDeniedError,
    DaemonUnavailableError,
    ProtocolError,
    UntrustedPathError,
)
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
EXIT_WAIT_S = 0.1
"""How long a dropped connection's daemon process may take to be seen exited (``daemon_exited``)."""
RECONNECT_S = 0.1
"""How soon after its last socket was opened a channel whose connection ended opens another."""
NEVER_MS = 10**9
"""libzmq's reconnect interval for a channel's sockets (11 days: never, in practice). Not -1,
which also ends the socket's pipe with the connection, dropping replies not read yet."""
MAX_UNSENT = 1000
"""Requests held for the next socket at most (libzmq's default send queue); the oldest go."""


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (``ZMQ_EVENTS``). With plain ints: pyzmq's enums
    cost about 0.7 us a check, paid twice per message on both sides of every call."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


class DaemonWatch(Protocol):
    """What a channel may know of the daemon's process: the pid it last approved and whether
    a pid has exited (``peer_check.DaemonUidCheck``)."""

    pid: int | None

    def exited(self, pid: int | None, wait_s: float = 0.0) -> bool: ...


class Channel:
    """A DEALER socket with request/reply matching by envelope id; used by one thread at a time.

    Two ways to use it: ``call`` sends one request and waits for its reply; ``send`` and
    ``receive`` keep many requests in flight, the caller matching replies to calls by the id
    ``send`` returned (``client.pipeline``). A DEALER rather than a REQ: a REQ socket whose
    reply is lost is stuck forever, while replies of earlier timed-out calls are recognised
    here by their id and dropped.

    Reconnecting (see the module's docstring): the monitor says when the socket's handshake
    succeeded and when its connection ended (``DISCONNECTED``, or ``CLOSED``: the connect
    failed). A request is handed to libzmq only once the handshake was seen to succeed;
    until then it waits here (``_unsent``), on this socket or the next ones, unless its call
    ends meanwhile (``withdraw``): once libzmq holds a frame, nothing can take it back, and
    it may leave the moment the handshake ends. A request handed over is never sent again
    (it may have left). A channel whose connection ended connects again while its owner
    waits in ``receive`` (the background thread always does), or at the next send.
    """

    _AUTH_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    _ENDED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
    _WATCHED = _AUTH_FAILURES | _ENDED | zmq.EVENT_HANDSHAKE_SUCCEEDED

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        sockopts: Mapping[int, int | bytes] | None = None,
        peer_refusal: Callable[[], str | None] | None = None,
        heard: Callable[[], None] | None = None,
        daemon: DaemonWatch | None = None,
    ) -> None:
        """``sockopts`` are set before connecting (the CURVE client keys, for one).
        ``peer_refusal``: why this client refused the daemon's end of a handshake, if it did
        (``peer_check.DaemonUidCheck.refusal``); a refused handshake is then reported as
        ``UntrustedPathError`` rather than as the daemon refusing this client.
        ``heard``: called for every frame the daemon sends (the breaker's sign of life).
        ``daemon``: the daemon's process, where the peer check can see it (``daemon_exited``)."""
        self._ctx, self._endpoint = ctx, endpoint
        self._sockopts = dict(sockopts or {})
        self._peer_refusal = peer_refusal
        self._ids = itertools.count(1)
        self._heard = heard
        self._daemon = daemon
        self._undecodable: Exception | None = None
        self.disconnects = 0
        """Connections of this socket the daemon closed, as seen so far (each send looks
        first, so a request counts as sent after every drop reported before it)."""
        self._refusal: str | None = None
        self._wake_fd: int | None = None
        self._unsent: dict[int, bytes] = {}  # request id -> frame, oldest first
        self._received: deque[bytes] = deque()  # replies read off a socket it replaced
        self._ended = self._handshaken = False  # of the current socket's one connection
        self._opened_at = 0.0
        self._sock, self._monitor = self._open()
        self._poller = self._make_poller()

    def _make_poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        if self._wake_fd is not None:
            poller.register(self._wake_fd, zmq.POLLIN)
        return poller

    def _open(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, NEVER_MS)  # one connection per socket: see the module
        for option, value in self._sockopts.items():
            sock.setsockopt(option, value)
        # A refused handshake or a dropped connection is otherwise silent: watch for them, to
        # connect again and so that a timed-out call can say why instead of just "no reply".
        monitor = sock.get_monitor_socket(self._WATCHED)
        sock.connect(self._endpoint)
        self._ended = self._handshaken = False
        self._opened_at = time.monotonic()
        return sock, monitor

    def _read_monitor(self) -> None:
        """Note what the monitor reported: a handshake done (the requests held back go out),
        the connection's end (``disconnects`` counts those the daemon closed), and a refused
        handshake, which the next ``receive`` raises."""
        while readable(self._monitor):
            event = parse_monitor_message(self._monitor.recv_multipart(NOBLOCK))
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif kind & self._ENDED:
                self._ended = True
                self.disconnects += kind == zmq.EVENT_DISCONNECTED
            else:
                self._refusal = f"handshake refused (ZMQ event {kind}, status {event['value']})"
        if self._unsent and self._handshaken and not self._ended:
            unsent, self._unsent = self._unsent, {}
            for request_id, frame in unsent.items():
                self._put(request_id, frame)

    def _put(self, request_id: int, frame: bytes) -> None:
        """Hand ``frame`` to libzmq if this socket's handshake succeeded and its connection
        did not end as far as seen, else hold it for later (``_unsent``)."""
        if self._handshaken and not self._ended:
            try:
                self._sock.send(frame, NOBLOCK)  # never blocks on a socket with no connection
                return
            except zmq.Again:  # not taken: the session ended (or its queue is full)
                self._ended = True
        self._unsent[request_id] = frame
        if len(self._unsent) > MAX_UNSENT:
            del self._unsent[next(iter(self._unsent))]

    def _reconnect(self) -> float:
        """A fresh socket if the connection ended and ``RECONNECT_S`` passed since the last
        one opened (the requests held back wait for its handshake); else how long until then
        (0 when the connection has not ended: nothing to wait for)."""
        if not self._ended:
            return 0.0
        wait = self._opened_at + RECONNECT_S - time.monotonic()
        if wait > 0:
            return wait
        while readable(self._sock):  # replies that came before the end: not lost with it
            self._received.append(self._sock.recv(NOBLOCK))
        self._replace()
        return 0.0

    def withdraw(self, request_id: int) -> None:
        """The call of ``request_id`` ended (failed as lost, or timed out): if its request
        is still held back (libzmq never had it), it is never sent."""
        self._unsent.pop(request_id, None)

    def _replace(self) -> None:
        self.close()
        self._sock, self._monitor = self._open()
        self._poller = self._make_poller()

    def _raise_refusal(self) -> None:
        if self._refusal is not None:
            reason, self._refusal = self._refusal, None
            raise self._refused(reason)

    def _refused(self, reason: str) -> AccessDeniedError:
        """The error for a refused handshake (the socket is reset: ZMQ would retry forever)."""
        self.reset()
        ours = self._peer_refusal() if self._peer_refusal is not None else None
        if ours is not None:
            return UntrustedPathError(f"not talking to {self._endpoint}: {ours}")
        return AccessDeniedError(
            f"the kvcache daemon at {self._endpoint} refused this client: {reason}; "
            "check its --clients allow-list, the CURVE keys, or the peer's uid"
        )

    def reset(self) -> None:
        """A fresh socket; what was sent on the old one, sent or not, is dropped."""
        self._refusal = None
        self._unsent.clear()
        self._replace()

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def send(self, body: m.RequestBody) -> int:
        """Send ``body`` under a fresh envelope id and return the id; never waits."""
        self._read_monitor()
        self._reconnect()
        request_id = next(self._ids)
        self._put(request_id, encode_request(request_id, body))
        return request_id

    def receive(self, timeout_s: float, wake_fd: int | None = None) -> list[m.ReplyEnvelope]:
        """The replies that arrived, waiting up to ``timeout_s`` for the first one (an empty
        list: the time passed, or ``wake_fd`` became readable; the caller drains it).

        Raises ``AccessDeniedError`` (``UntrustedPathError`` when this client refused the
        daemon) on a refused handshake, after resetting the socket: ZMQ would only retry it,
        and every call in flight on it is lost. Raises ``ProtocolError`` for a reply it
        cannot decode; the replies behind it stay for the next call."""
        if self._undecodable is not None:
            undecodable, self._undecodable = self._undecodable, None
            raise _protocol_error(undecodable) from None
        if wake_fd is not None and wake_fd != self._wake_fd:
            self._wake_fd = wake_fd
            self._poller = self._make_poller()
        self._raise_refusal()  # one the last send saw: before connecting again
        if (wait := self._reconnect()) > 0:  # back in time to connect again
            timeout_s = min(timeout_s, wait)
        if self._received:
            timeout_s = 0
        ready = dict(self._poller.poll(max(math.ceil(timeout_s * 1000), 0)))
        if self._monitor in ready or not ready:
            self._read_monitor()
        self._raise_refusal()  # a refused handshake ends the calls at once: ZMQ would only retry it
        self._reconnect()
        out: list[m.ReplyEnvelope] = []
        while self._received or readable(self._sock):
            frame = self._received.popleft() if self._received else self._sock.recv(NOBLOCK)
            if self._heard is not None:
                self._heard()
            try:
                out.append(decode_reply(frame))
            except (msgspec.DecodeError, ValueError) as exc:
                if out:  # hand over what decoded; the next call raises for this frame
                    self._undecodable = exc
                    return out
                raise _protocol_error(exc) from None
        return out

    @property
    def daemon_pid(self) -> int | None:
        """The daemon process a request sent now goes to, as far as this client knows."""
        return self._daemon.pid if self._daemon is not None else None

    def daemon_exited(self, pid: int | None) -> bool:
        """Whether daemon process ``pid`` (the one a request went to) has exited; asked once a
        connection dropped. A request sent to it is then failed at once, not at its timeout:
        it will never be answered, and a process that exited copies nothing more (its
        mappings of the engine's memory, and its CUDA contexts, ended with it), so the
        engine may use its blocks again. A connection that dropped under a live daemon (its
        connection cap, say) proves nothing, and its calls wait as before. The drop is seen
        as the dying process's sockets close, a moment before it has exited: this waits up
        to ``EXIT_WAIT_S`` for that."""
        return self._daemon is not None and self._daemon.exited(pid, EXIT_WAIT_S)

    def lost_error(self, body: m.RequestBody, pid: int | None) -> DaemonUnavailableError:
        return DaemonUnavailableError(
            f"the kvcache daemon at {self._endpoint} (pid {pid}) exited with this "
            f"{type(body).__name__} in flight: it was not served, and nothing of it is still running"
        )

    def timeout_error(self, body: m.RequestBody, timeout_s: float, closed: bool) -> DaemonUnavailableError:
        """The error of a call that got no reply within ``timeout_s``; ``closed``: the daemon
        closed a connection of this socket meanwhile."""
        if closed:
            return DaemonUnavailableError(
                f"the kvcache daemon at {self._endpoint} closed the connection and sent no "
                f"reply within {timeout_s:g} s ({type(body).__name__}): "
                "it closes a connection whose request exceeds its --max-message-mb, and "
                "new connections while at its --max-connections; or it restarted"
            )
        return DaemonUnavailableError(
            f"no reply from the kvcache daemon at {self._endpoint} within {timeout_s:g} s "
            f"({type(body).__name__}); is `python -m kvcache.server` running?"
        )

    def call(self, body: m.RequestBody, timeout_s: float) -> m.ReplyBody:
        """Send ``body`` and wait for its reply, dropping replies of earlier calls. On a
        timeout the socket is reset (a lost reply must not wedge it): only for a socket that
        has nothing else in flight."""
        request_id = self.send(body)  # reads the monitor first: drops seen so far are before it
        disconnects = seen = self.disconnects
        pid = self.daemon_pid
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            for envelope in self.receive(remaining):
                if envelope.id == request_id or envelope.id == 0:
                    return envelope.body
            if self.disconnects != seen:
                seen = self.disconnects
                if self.daemon_exited(pid):
                    self.reset()
                    raise self.lost_error(body, pid)
        self._refusal_now()
        closed = self.disconnects != disconnects
        self.reset()
        raise self.timeout_error(body, timeout_s, closed)

    def _refusal_now(self) -> None:
        """Read the monitor once more before giving up: a refusal is the better error."""
        self._read_monitor()
        self._raise_refusal()


def _protocol_error(exc: Exception) -> ProtocolError:
    return ProtocolError(
        f"cannot decode the daemon's reply ({exc}); are client and daemon the same kvcache version?"
    )


__all__ = ["NOBLOCK", "Channel", "readable"]
