"""The client's DEALER channel against a hand-driven ROUTER: matching, staleness, timeouts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


# -- reconnecting: libzmq never does it for a channel (one connection per socket) -------------


def _ipc_router(path: Path) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{path}")
    return sock


def _requests(router: zmq.Socket[bytes], chan: Channel, wait_s: float) -> list[int]:
    """The ids of the requests ``router`` got within ``wait_s``, the channel's owner waiting
    on it meanwhile (which is when it connects again)."""
    ids: list[int] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        chan.receive(0.02)
        while router.poll(0):
            ids.append(decode_request(router.recv_multipart()[1]).id)
    return ids


def test_a_request_sent_before_the_daemon_listens_is_sent_once_it_does(tmp_path: Path) -> None:
    path = tmp_path / "daemon.sock"
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    first = chan.send(m.Ping())
    assert chan.receive(0.3) == []  # the connect fails (nothing there); the channel retries
    router = _ipc_router(path)
    assert _requests(router, chan, 1.0) == [first]
    chan.close()
    router.close()


def test_a_request_on_a_connection_dropped_mid_handshake_is_sent_again_once(tmp_path: Path) -> None:
    """The peer drops the connection before the handshake ends: the request never left, so
    the next socket sends it, and only once."""
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    sent = chan.send(m.Ping())
    conn, _ = listener.accept()
    conn.recv(10)  # the client's signature; no greeting back
    conn.close()
    listener.close()
    path.unlink()
    before = chan.disconnects
    while chan.disconnects == before:
        chan.receive(0.02)
    router = _ipc_router(path)
    assert _requests(router, chan, 1.0) == [sent]
    chan.close()
    router.close()


def test_a_withdrawn_request_is_never_sent_and_one_that_left_never_twice(tmp_path: Path) -> None:
    path = tmp_path / "daemon.sock"
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    withdrawn = chan.send(m.Ping())
    chan.receive(0.2)
    chan.withdraw(withdrawn)  # its call ended (timed out) before anything listened
    router = _ipc_router(path)
    kept = chan.send(m.Ping())
    assert _requests(router, chan, 0.5) == [kept]
    before = chan.disconnects
    router.close()  # the connection ends: what left with it is not sent again
    while chan.disconnects == before:
        chan.receive(0.02)
    path.unlink(missing_ok=True)
    router = _ipc_router(path)
    after = chan.send(m.Ping())
    assert _requests(router, chan, 1.0) == [after]
    chan.close()
    router.close()
