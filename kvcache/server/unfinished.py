"""Unfinished messages on TCP: a connection that keeps sending and never finishes a message is cut.

Why the daemon needs this: libzmq shows the daemon a message only once its last frame has
arrived, and keeps every finished frame of a multipart message until then. ``ZMQ_MAXMSGSIZE``
bounds each frame, not the message, and the daemon's high-water mark counts whole messages.
So a peer sending frame after frame with the MORE flag set grew the daemon without limit,
and nothing of it ever reached code that could count it. (A request is one frame: a finished
multipart message is refused as ``BAD_MESSAGE``.)

What bounds it: the kernel counts the bytes each TCP connection received
(``TCP_INFO``'s ``tcpi_bytes_received``), and the I/O loop knows when a connection last
delivered a request. Frames of one connection arrive in order, so while a message is
unfinished no other message of that connection can finish: the bytes received since its last
delivered request are that message (with what the kernel still buffers and a little protocol
overhead). The I/O loop looks every ``CHECK_EVERY_S`` and shuts down (``shutdown(2)``) a
connection past ``limit``: one message cap, the connection's kernel receive buffer and
``OVERHEAD_BYTES``. An attack is thus held to that per connection plus what the daemon's
libzmq thread reads in one check interval (the I/O loop reads requests for one interval at
most, so a flood of them cannot hold a check off). Those are bytes received, not held: libzmq
keeps a 64-byte message per frame, so empty frames (2 bytes on the wire) hold about 32 times
as much (a known gap: ``tests/security/test_caps_bypass.py``). The limit does not grow with time, so a peer
trickling a message byte by byte is held to it too; the price is that a connection idle for
days, whose heartbeat replies alone add up to ``OVERHEAD_BYTES``, is cut as well (its
client's libzmq connects again; an idle connection has nothing in flight).

The Unix socket is not covered: it has no byte counter, and only the daemon's own uid
reaches it (``docs/operator-guide.md``).
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

CHECK_EVERY_S = 0.1
"""How often the I/O loop reads the counters (it wakes at least this often)."""
OVERHEAD_BYTES = 1 << 20
"""Bytes a connection may receive beyond its requests: the greeting, the handshake, CURVE's
per-message boxes, frame headers, and heartbeat replies (7 to about 50 bytes each, one per
``--peer-heartbeat`` interval: 2 to 17 days' worth at 10 s)."""

_TCP_INFO_LEN = 136  # up to tcpi_bytes_received (Linux >= 4.1)
_BYTES_RECEIVED = struct.Struct("=Q")
_BYTES_RECEIVED_AT = 128


def bytes_received(sock: socket.socket) -> int | None:
    """What the kernel has received on TCP ``sock`` so far, or None where it cannot tell."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):  # not TCP, closed, or no TCP_INFO on this platform
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return int(_BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0])


@dataclass(slots=True)
class _Mark:
    received: int  # what the kernel had received when the connection last delivered a request
    delivered: bool = False  # a request of it was read since the last check
    now: int = 0  # what the kernel had received at this check's start (``snapshot``)


class UnfinishedMessages:
    """The byte marks of the admitted TCP connections, kept by ``ConnectionGuard`` on the
    daemon's I/O thread: ``watch`` on accept, ``delivered`` for each request read, ``forget``
    on close. A check (every ``CHECK_EVERY_S``) takes each connection's count (``snapshot``),
    lets the I/O loop read every request waiting, then judges each (``over``). In that order,
    requests that libzmq had finished but the daemon had not read yet (a stall of the I/O
    thread) count as delivered, so a busy connection is never taken for an endless one."""

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._marks: dict[int, _Mark] = {}
        self._checked_at = 0.0

    def watch(self, fd: int, sock: socket.socket) -> None:
        received = bytes_received(sock)
        if received is not None:
            self._marks[fd] = _Mark(received)

    def forget(self, fd: int) -> None:
        self._marks.pop(fd, None)

    def delivered(self, fd: int) -> None:
        mark = self._marks.get(fd)
        if mark is not None:
            mark.delivered = True

    def due(self) -> bool:
        """Whether a check is due now (then it counts as begun)."""
        now = time.monotonic()
        if not self._marks or now - self._checked_at < CHECK_EVERY_S:
            return False
        self._checked_at = now
        return True

    @property
    def fds(self) -> list[int]:
        return list(self._marks)

    @property
    def to_judge(self) -> list[int]:
        """The connections ``over`` must look at with their socket: those that delivered
        (they start afresh) and those past one message and its overhead (they may be cut).
        The rest, idle ones mostly, cost the check nothing more than their snapshot."""
        floor = self.max_message_bytes + OVERHEAD_BYTES
        return [fd for fd, m in self._marks.items() if m.delivered or m.now - m.received > floor]

    def snapshot(self, fd: int, sock: socket.socket) -> None:
        mark = self._marks.get(fd)
        received = bytes_received(sock)
        if mark is not None and received is not None:
            mark.now = received

    def over(self, fd: int, sock: socket.socket) -> str | None:
        """Judge the connection on ``fd`` (``sock`` over it) after ``snapshot`` and the read:
        why it must be cut, or None. One that delivered a request since the last check
        starts afresh from what it received by now: the last request read may have ended
        after the snapshot (the I/O loop stalled between the two), and its tail must not
        count against the next message. What this leaves uncounted of a message begun before
        the read is what arrived while the loop read (at most ``CHECK_EVERY_S``)."""
        mark = self._marks.get(fd)
        if mark is None:
            return None
        if mark.delivered:  # count from now: a request read may have ended after the snapshot
            received = bytes_received(sock)
            mark.received, mark.delivered = mark.now if received is None else received, False
            return None
        pending = mark.now - mark.received
        if pending <= self.limit(sock):
            return None
        received = bytes_received(sock)
        if received is None or received < mark.now:  # not the connection of the snapshot
            self.forget(fd)
            return None
        self.forget(fd)
        return (
            f"{pending} bytes received since its last whole request, past one message "
            f"(--max-message-mb {self.max_message_bytes / (1 << 20):g}): a message that never ends"
        )

    def limit(self, sock: socket.socket) -> int:
        """The bytes a connection may receive without delivering a request."""
        try:
            buffered = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        except OSError:
            buffered = 0
        return self.max_message_bytes + buffered + OVERHEAD_BYTES


__all__ = ["CHECK_EVERY_S", "UnfinishedMessages", "bytes_received"]
