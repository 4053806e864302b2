"""The client's DEALER channel against a hand-driven ROUTER: matching, staleness, timeouts."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvcache.errors import ProtocolError
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel, readable
from kvcache.protocol.codec import decode_request, encode_reply
from kvcache.protocol.errors import DaemonUnavailableError
from tests.helpers import wait_until
from tests.security import zmtp


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


def _pump(chan: Channel, until: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Wait on ``chan`` as its owner does (which is when it connects again and hands over
    what it held back) until ``until()`` or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while not until() and time.monotonic() < deadline:
        chan.receive(0.02)


def _requests(router: zmq.Socket[bytes], chan: Channel, expected: int) -> list[int]:
    """The ids of the requests ``router`` got: waits for ``expected`` of them (10 s at most),
    then 0.3 s more for any that should not come."""
    ids: list[int] = []

    def take() -> bool:
        while router.poll(0):
            ids.append(decode_request(router.recv_multipart()[1]).id)
        return len(ids) >= expected

    _pump(chan, take)
    end = time.monotonic() + 0.3
    _pump(chan, lambda: take() and time.monotonic() > end)
    return ids


def test_a_request_sent_before_the_daemon_listens_is_sent_once_it_does(tmp_path: Path) -> None:
    path = tmp_path / "daemon.sock"
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    first = chan.send(m.Ping())
    assert chan.receive(0.3) == []  # the connect fails (nothing there); the channel retries
    router = _ipc_router(path)
    assert _requests(router, chan, 1) == [first]
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
    _pump(chan, lambda: chan.disconnects != before)
    router = _ipc_router(path)
    assert _requests(router, chan, 1) == [sent]
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
    assert _requests(router, chan, 1) == [kept]
    before = chan.disconnects
    router.close()  # the connection ends: what left with it is not sent again
    _pump(chan, lambda: chan.disconnects != before)
    path.unlink(missing_ok=True)
    router = _ipc_router(path)
    after = chan.send(m.Ping())
    assert _requests(router, chan, 1) == [after]
    chan.close()
    router.close()


class _HeldPeer:
    """A hand-driven ZMTP peer at ``path``: holds each connection silent (the client's
    handshake waits on it) until ``release``, then completes the handshake on every one and
    records the ids of the requests that arrive."""

    def __init__(self, path: Path) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._released = threading.Event()
        self.connections = 0
        self.ids: list[int] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self._released.wait()
        conn.settimeout(10)
        with conn, contextlib.suppress(OSError):  # the client closed it: nothing more comes
            conn.sendall(zmtp._GREETING + zmtp._READY)
            zmtp._read_exact(conn, 64)  # the client's greeting
            while True:
                flags, body = zmtp.read_frame(conn)
                if not flags & 0x04:  # a message, not a command (the client's READY)
                    self.ids.append(decode_request(body).id)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._listener.close()


def test_a_request_withdrawn_while_its_handshake_waits_is_never_sent(tmp_path: Path) -> None:
    """The peer accepts the connection but holds its handshake; the call ends meanwhile
    (``withdraw``), then the peer completes the handshake: the withdrawn request must not
    leave on it, the others must, once."""
    path = tmp_path / "daemon.sock"
    peer = _HeldPeer(path)
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    withdrawn = chan.send(m.Ping())
    _pump(chan, lambda: peer.connections > 0)  # connected; the handshake waits on the peer
    assert peer.connections == 1
    kept = chan.send(m.Ping())
    chan.withdraw(withdrawn)
    peer.release()
    _pump(chan, lambda: bool(peer.ids))
    end = time.monotonic() + 0.3  # time for anything else to arrive
    _pump(chan, lambda: time.monotonic() > end)
    assert peer.ids == [kept]
    chan.close()
    peer.close()


def test_a_reply_that_came_before_the_connection_ended_is_still_received(tmp_path: Path) -> None:
    """The daemon answers, then closes (a stop, a restart): the reply waits in the socket when
    the channel learns that its connection ended, and must not go with the socket it replaces."""
    path = tmp_path / "daemon.sock"
    router = _ipc_router(path)
    chan = Channel(zmq.Context.instance(), f"ipc://{path}")
    sent = chan.send(m.Ping())
    _pump(chan, lambda: bool(router.poll(0)))
    identity, _ = router.recv_multipart()
    router.send_multipart([identity, encode_reply(sent, m.LookupResult(hit_tokens=1))])
    router.close(linger=1000)  # the reply leaves first
    # Both the reply and the connection's end wait for the owner (read on the channel's own
    # sockets: the owner's next receive must find them both).
    wait_until(lambda: readable(chan._sock) and readable(chan._monitor), 10, "the reply and the end")
    got: list[int] = []
    _pump(chan, lambda: bool(got.extend(e.id for e in chan.receive(0.05)) or got), limit_s=2)
    assert got == [sent]
    chan.close()
