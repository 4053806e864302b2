"""Fixtures for the hostile-client suite: real daemon processes and raw sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request
from kvcache.server.launch import DaemonProcess
from tests.helpers import daemon_starter

BASE_ARGS = ["--chunk-size", "16", "--l1-size-gb", "0.2", "--heartbeat-timeout", "5"]


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    """Factory for daemon processes that are killed (and their socket dirs removed) at the end."""
    yield from daemon_starter(BASE_ARGS)


def raw_call(endpoint: str, body: m.RequestBody, timeout_ms: int = 5000) -> m.ReplyBody:
    """One request on a fresh DEALER, as a hand-written hostile client would send it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_request(1, body))
        assert sock.poll(timeout_ms), "no reply from the daemon"
        return decode_reply(sock.recv()).body
    finally:
        sock.close()
