"""Handing memfds from an engine to the daemon: ``SCM_RIGHTS`` over a private Unix socket.

Why descriptors and not paths: a path lets a client make the daemon open (or delete) a file
of its choosing, and a file the engine can still shrink lets it kill the daemon with SIGBUS.
A memfd sealed against shrinking (``ipc.empty_shared``) handed over as a descriptor has
neither problem, needs no /dev/shm entry to clean up, and works between containers that
share no /proc.

Protocol, one exchange per connection on an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket: the client
sends one message whose payload is a random ticket (16 to 64 bytes) and whose ancillary data
carries the descriptors; the daemon answers one ``FdReply``. The client then names the ticket
in its ``Register`` request; ``FdInbox.take`` hands the checked descriptors to the handler.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError

log = logging.getLogger("kvcache.server")

MIN_TICKET, MAX_TICKET = 16, 64
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FdReply(msgspec.Struct, frozen=True):
    """The daemon's answer to a hand-over: ``code`` is "" on success."""

    code: str = ""
    message: str = ""


_ERRORS: dict[str, type[Exception]] = {
    "access_denied": AccessDeniedError,
    "limit": LimitExceededError,
    "layout": LayoutError,
}
_REPLY_DECODER = msgspec.msgpack.Decoder(FdReply)


# -- client side --------------------------------------------------------------------------


def send_fds(socket_path: str, ticket: bytes, fds: list[int], timeout_s: float) -> None:
    """Hand ``fds`` to the daemon under ``ticket``; raises the daemon's refusal as the
    matching kvcache error, ``ConnectionError`` when the socket cannot be reached."""
    if not MIN_TICKET <= len(ticket) <= MAX_TICKET:
        raise ValueError(f"a ticket is {MIN_TICKET}..{MAX_TICKET} bytes, got {len(ticket)}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise ConnectionError(
                f"cannot reach the daemon's fd socket {socket_path}: {exc.strerror}; CPU engines "
                "must run on the daemon's host, as its user (or a uid in its --clients)"
            ) from None
        socket.send_fds(sock, [ticket], fds)
        data = sock.recv(4096)
    if not data:
        raise ConnectionError(f"the daemon closed {socket_path} without answering")
    reply = _REPLY_DECODER.decode(data)
    if reply.code:
        raise _ERRORS.get(reply.code, LayoutError)(reply.message)


# -- daemon side --------------------------------------------------------------------------


@dataclass
class ReceivedFds:
    """Checked descriptors of one hand-over, with their sizes and the sender's credentials.

    The sizes were read after the seals were checked, so they can only grow."""

    fds: list[int]
    sizes: list[int]
    uid: int
    pid: int
    expires: float = field(default=0.0, repr=False)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class FdInbox:
    """The daemon's fd socket: receives, checks and holds descriptors until ``take``.

    Bounded in every way a client controls: descriptors per hand-over, tickets pending, time a
    ticket waits, time a connection may take; whatever is refused is closed at once.
    """

    def __init__(
        self,
        socket_path: str,
        allowed_uids: frozenset[int],
        *,
        max_fds_per_ticket: int = 1024,
        max_pending: int = 64,
        ticket_ttl_s: float = 60.0,
        connection_timeout_s: float = 2.0,
    ) -> None:
        self.path = socket_path
        self.allowed_uids = allowed_uids
        self.max_fds_per_ticket = max_fds_per_ticket
        self.max_pending = max_pending
        self.ticket_ttl_s = ticket_ttl_s
        self.connection_timeout_s = connection_timeout_s
        self.refused = 0
        self._pending: dict[bytes, ReceivedFds] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvcache-fds")
        self._stop = threading.Event()

    def start(self) -> None:
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.settimeout(0.2)  # so close() is noticed promptly
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="kvcache-fd-inbox", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            self._pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        """One hand-over; never raises, never keeps a descriptor it refused."""
        fds: list[int] = []
        with conn:
            conn.settimeout(self.connection_timeout_s)
            try:
                pid, uid, _ = _UCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
                # Read first, refuse after: closing with a message unread resets the
                # connection, and the peer would never see why it was refused.
                ticket, fds = self._receive(conn)
                if uid not in self.allowed_uids:
                    raise AccessDeniedError(f"uid {uid} may not hand memory to this daemon")
                sizes = [_checked_size(fd) for fd in fds]
                self._keep(ticket, ReceivedFds(fds, sizes, uid, pid))
                fds = []  # kept: no longer ours to close
                reply = FdReply()
            except (AccessDeniedError, LimitExceededError, LayoutError) as exc:
                self.refused += 1
                log.warning("fd socket: refused a hand-over: %s", exc)
                reply = FdReply(code=_code(exc), message=str(exc))
            except OSError as exc:  # timeout, peer gone: nothing to answer
                log.info("fd socket: dropped a connection: %s", exc)
                reply = None
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if reply is not None:
                with contextlib.suppress(OSError):
                    conn.send(msgspec.msgpack.encode(reply))

    def _receive(self, conn: socket.socket) -> tuple[bytes, list[int]]:
        fd_bytes = self.max_fds_per_ticket * array.array("i").itemsize
        msg, ancdata, flags, _ = conn.recvmsg(MAX_TICKET + 1, socket.CMSG_SPACE(fd_bytes))
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
                fds += list(arr)
        try:
            if flags & socket.MSG_CTRUNC:
                raise LimitExceededError(
                    f"more than {self.max_fds_per_ticket} descriptors in one hand-over"
                )
            if flags & socket.MSG_TRUNC or not MIN_TICKET <= len(msg) <= MAX_TICKET:
                raise LayoutError(f"a ticket is {MIN_TICKET}..{MAX_TICKET} bytes")
            if not fds:
                raise LayoutError("a hand-over must carry at least one descriptor")
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        return bytes(msg), fds

    def _keep(self, ticket: bytes, received: ReceivedFds) -> None:
        now = time.monotonic()
        received.expires = now + self.ticket_ttl_s
        with self._lock:
            self._expire(now)
            if ticket in self._pending:
                raise AccessDeniedError("that ticket is already in use")
            if len(self._pending) >= self.max_pending:
                raise LimitExceededError(f"{self.max_pending} hand-overs are waiting to be registered")
            self._pending[ticket] = received

    def _expire(self, now: float) -> None:
        for ticket in [t for t, r in self._pending.items() if r.expires <= now]:
            self._pending.pop(ticket).close()

    def take(self, ticket: bytes) -> ReceivedFds:
        """The descriptors handed over under ``ticket`` (now the caller's to close)."""
        with self._lock:
            self._expire(time.monotonic())
            received = self._pending.pop(ticket, None)
        if received is None:
            raise AccessDeniedError(
                "no descriptors were handed over under this ticket (unknown, used or expired)"
            )
        return received

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for received in self._pending.values():
                received.close()
            self._pending.clear()


def _checked_size(fd: int) -> int:
    """The size of ``fd`` if it is a memfd sealed against shrinking; ``LayoutError`` if not."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise LayoutError("a handed-over descriptor is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a sealable file (disk files, /dev/shm files)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise LayoutError(
            "a handed-over descriptor is not a memfd sealed against shrinking; allocate CPU KV "
            "tensors with kvcache.client.empty_shared"
        )
    return st.st_size


def _code(exc: Exception) -> str:
    if isinstance(exc, AccessDeniedError):
        return "access_denied"
    if isinstance(exc, LimitExceededError):
        return "limit"
    return "layout"


def _remove_stale_socket(path: str) -> None:
    """Unlink a socket file left by a daemon that died; refuse if one still listens there."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)
            return
    raise OSError(f"another kvcache daemon listens on {path}; stop it or pick another --runtime-dir")


__all__ = ["FdInbox", "FdReply", "ReceivedFds", "send_fds"]
