"""The client end of the daemon protocol: send one request, wait for its reply, or time out.

Separate from ``KVCacheClient`` (which knows what to ask) so that the socket discipline, the
one part that must survive a daemon restart, can be read on its own.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import zmq

from kvcache.errors import ProtocolError
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request
from kvcache.protocol.errors import DaemonUnavailableError


class Channel:
    """A DEALER socket with request/reply matching; used by one thread at a time.

    A DEALER rather than a REQ: a REQ socket whose reply is lost is stuck forever, while this
    one is simply thrown away and reopened after a timeout, and replies of earlier timed-out
    calls are recognised by their id and dropped.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self._ctx, self._endpoint = ctx, endpoint
        self._ids = itertools.count(1)
        self._sock = self._open()

    def _open(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        return sock

    def reset(self) -> None:
        self._sock.close(linger=0)
        self._sock = self._open()

    def close(self) -> None:
        self._sock.close(linger=0)

    def call(self, body: m.RequestBody, timeout_s: float) -> m.ReplyBody:
        request_id = next(self._ids)
        self._sock.send(encode_request(request_id, body))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._sock.poll(remaining_ms):
                self.reset()
                raise DaemonUnavailableError(
                    f"no reply from the kvcache daemon at {self._endpoint} within {timeout_s:g} s "
                    f"({type(body).__name__}); is `python -m kvcache.server` running?"
                )
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
