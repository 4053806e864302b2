"""The client end of the daemon protocol: send one request, wait for its reply, or time out.

Separate from ``KVCacheClient`` (which knows what to ask) so that the socket discipline, the
one part that must survive a daemon restart, can be read on its own.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

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


class Channel:
    """A DEALER socket with request/reply matching; used by one thread at a time.

    A DEALER rather than a REQ: a REQ socket whose reply is lost is stuck forever, while this
    one is simply thrown away and reopened after a timeout, and replies of earlier timed-out
    calls are recognised by their id and dropped.
    """

    _AUTH_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    _WATCHED = _AUTH_FAILURES | zmq.EVENT_DISCONNECTED

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        sockopts: Mapping[int, int | bytes] | None = None,
        peer_refusal: Callable[[], str | None] | None = None,
    ) -> None:
        """``sockopts`` are set before connecting (the CURVE client keys, for one).
        ``peer_refusal``: why this client refused the daemon's end of a handshake, if it did
        (``peer_check.DaemonUidCheck.refusal``); a refused handshake is then reported as
        ``UntrustedPathError`` rather than as the daemon refusing this client."""
        self._ctx, self._endpoint = ctx, endpoint
        self._sockopts = dict(sockopts or {})
        self._peer_refusal = peer_refusal
        self._ids = itertools.count(1)
        self._sock, self._monitor = self._open()
        self._poller = self._make_poller()

    def _make_poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        return poller

    def _open(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in self._sockopts.items():
            sock.setsockopt(option, value)
        # A refused handshake or a dropped connection is otherwise silent (ZMQ reconnects):
        # watch for them so a timed-out call can say why instead of just "no reply".
        monitor = sock.get_monitor_socket(self._WATCHED)
        sock.connect(self._endpoint)
        return sock, monitor

    def _refusal(self) -> tuple[str | None, bool]:
        """The reason of a refused handshake seen on this socket, if any, and whether the
        daemon closed a connection of it."""
        reason, dropped = None, False
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                dropped = True
            else:
                reason = f"handshake refused (ZMQ event {event['event']}, status {event['value']})"
        return reason, dropped

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
        self.close()
        self._sock, self._monitor = self._open()
        self._poller = self._make_poller()

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def call(self, body: m.RequestBody, timeout_s: float) -> m.ReplyBody:
        request_id = next(self._ids)
        frame = encode_request(request_id, body)
        self._sock.send(frame)
        deadline = time.monotonic() + timeout_s
        closed_by_daemon = False
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(self._poller.poll(max(remaining_ms, 0)))
            if self._monitor in ready or not ready:
                # A refused handshake ends the call at once: ZMQ would only retry it.
                refused, dropped = self._refusal()
                closed_by_daemon = closed_by_daemon or dropped
                if refused is not None:
                    raise self._refused(refused)
            if not ready:
                self.reset()
                if closed_by_daemon:
                    raise DaemonUnavailableError(
                        f"the kvcache daemon at {self._endpoint} closed the connection and sent no "
                        f"reply within {timeout_s:g} s ({type(body).__name__}, {len(frame)} bytes): "
                        "it closes a connection whose request exceeds its --max-message-mb, and "
                        "new connections while at its --max-connections; or it restarted"
                    )
                raise DaemonUnavailableError(
                    f"no reply from the kvcache daemon at {self._endpoint} within {timeout_s:g} s "
                    f"({type(body).__name__}); is `python -m kvcache.server` running?"
                )
            if self._sock not in ready:
                continue  # monitor events only
            try:
                envelope = decode_reply(self._sock.recv())
            except (msgspec.DecodeError, ValueError) as exc:
                raise ProtocolError(
                    f"cannot decode the daemon's reply ({exc}); are client and daemon the same "
                    "kvcache version?"
                ) from None
            if envelope.id == request_id or envelope.id == 0:
                return envelope.body


__all__ = ["Channel"]
