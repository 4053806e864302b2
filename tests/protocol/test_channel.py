"""The client's DEALER channel against a hand-driven ROUTER: matching, staleness, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvcache.errors import ProtocolError
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel
from kvcache.protocol.codec import decode_request, encode_reply
from kvcache.protocol.errors import DaemonUnavailableError


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close()


def _serve_once(sock: zmq.Socket[bytes], respond: Callable[[bytes, int], list[bytes]]) -> threading.Thread:
    def run() -> None:
        identity, frame = sock.recv_multipart()
        for payload in respond(identity, decode_request(frame).id):
            sock.send_multipart([identity, payload])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_replies_of_other_ids_are_dropped(router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = router
    chan = Channel(zmq.Context.instance(), endpoint)
    t = _serve_once(sock, lambda ident, rid: [
        encode_reply(rid + 100, m.LookupResult(hit_tokens=1)),  # a late reply to someone else
        encode_reply(rid, m.LookupResult(hit_tokens=2)),
    ])  # fmt: skip
    assert chan.call(m.Ping(), 5) == m.LookupResult(hit_tokens=2)
    t.join()
    chan.close()


def test_silence_is_a_timeout_and_the_socket_is_replaced(router: tuple[zmq.Socket[bytes], str]) -> None:
    _, endpoint = router
    chan = Channel(zmq.Context.instance(), endpoint)
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=r"within 0\.2 s"):
        chan.call(m.Ping(), 0.2)
    assert 0.15 < time.monotonic() - start < 2
    chan.close()


def test_garbage_reply_is_a_protocol_error(router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = router
    chan = Channel(zmq.Context.instance(), endpoint)
    t = _serve_once(sock, lambda ident, rid: [b"\xc1not msgpack"])
    with pytest.raises(ProtocolError, match="same kvcache version"):
        chan.call(m.Ping(), 5)
    t.join()
    chan.close()
