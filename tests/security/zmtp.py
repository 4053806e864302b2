"""A hand-written ZMTP 3.1 peer over a plain socket, for clients libzmq would not be.

libzmq clients answer pings, finish their frames and never hold a connection half open; a
hostile peer does all three. This speaks just enough of ZMTP (RFC 37) with the NULL mechanism
to get past the daemon's handshake and then misbehave on purpose.
"""

from __future__ import annotations

import socket
import struct

_COMMAND, _LONG = 0x04, 0x02


def connect(endpoint: str, timeout_s: float = 10.0) -> socket.socket:
    """A plain connection to a ``tcp://host:port`` or ``ipc://path`` endpoint (nothing sent)."""
    if endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(endpoint.removeprefix("ipc://"))
        return sock
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)


def flood(endpoint: str, count: int, patience_s: float = 2.0) -> list[socket.socket]:
    """Up to ``count`` connections, one after another, held open and silent; stops early at
    the first connect left unanswered for ``patience_s`` (the daemon's listener is shut, or
    its accept queue is full because it can accept no more)."""
    out: list[socket.socket] = []
    for _ in range(count):
        try:
            out.append(connect(endpoint, timeout_s=patience_s))
        except TimeoutError:
            break
    return out


def _command(name: bytes, data: bytes) -> bytes:
    body = bytes([len(name)]) + name + data
    return bytes([_COMMAND, len(body)]) + body


_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32)
_READY = _command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")


def handshake(sock: socket.socket) -> None:
    """Greeting and READY as a DEALER with the NULL mechanism; raises if the daemon refuses."""
    sock.sendall(_GREETING)
    _read_exact(sock, 64)
    sock.sendall(_READY)
    _handshake_reply(sock)


def blurt(sock: socket.socket) -> None:
    """Greeting and READY in one write, right after the connect, without waiting for the
    daemon's greeting (``after_blurt`` reads its answer): the handshake then takes the
    daemon's round trip alone. A message frame may not follow in the same write: libzmq
    drops a peer whose message comes before the daemon's own READY went out."""
    sock.sendall(_GREETING + _READY)


def after_blurt(sock: socket.socket) -> None:
    """Read the daemon's greeting and READY that answer ``blurt``; raises if it refused."""
    _read_exact(sock, 64)
    _handshake_reply(sock)


def _handshake_reply(sock: socket.socket) -> None:
    flags, body = read_frame(sock)
    if not flags & _COMMAND or not body.startswith(b"\x05READY"):
        raise ConnectionError(f"the daemon did not accept the handshake: {body[:64]!r}")


def frame_header(size: int, more: bool = False) -> bytes:
    """The header of a message frame announcing ``size`` bytes."""
    flags = 0x01 if more else 0
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | _LONG]) + struct.pack(">Q", size)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """(flags, body) of the next frame or command; ``ConnectionError`` when the daemon closed."""
    flags = _read_exact(sock, 1)[0]
    size = struct.unpack(">Q", _read_exact(sock, 8))[0] if flags & _LONG else _read_exact(sock, 1)[0]
    return flags, _read_exact(sock, size)


def wait_closed(sock: socket.socket) -> bool:
    """Read (and drop) whatever the daemon sends until it closes: True, or False when the
    socket's timeout passes first."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        out += chunk
    return bytes(out)
