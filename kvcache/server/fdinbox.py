"""The daemon's end of the fd socket: receives memfds, checks them, holds them per ticket.

Split from ``kvcache.transport.fdpass`` (the engine's end) because this half runs a thread,
keeps state and enforces every bound a client controls, while the engine's half is one
blocking exchange; they share only the wire format and the ``ReceivedFds`` record
(``kvcache.transport.fdproto``). It stays in ``server/`` because it is daemon state.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvcache import trusted_dir
from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError
from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM, free_descriptors
from kvcache.transport.fdproto import FD_SIZE, MAX_TICKET, MIN_TICKET, FdReply, ReceivedFds, refusal_code

log = logging.getLogger("kvcache.server")


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float


class FdInbox:
    """The daemon's fd socket: receives, checks and holds descriptors until ``take``.

    One thread multiplexes every connection (``selectors``) and never blocks on a peer: a
    SEQPACKET message arrives whole, so a connection is served, in a few syscalls per
    descriptor, only once its message is there. Bounded in every way a client controls:
    descriptors per hand-over, tickets pending per engine (the sending process: one engine
    that hands memory over and never registers fills only its own quota, not its user's),
    tickets and descriptors pending per uid, tickets pending in all, time a ticket
    waits (``ticket_ttl_s``), time a connection may stay silent (``connection_timeout_s``),
    connections open at once (``max_connections``; the oldest is dropped for a new one),
    descriptors received at once (never more than the process can spare beyond
    ``fd_budget.DESCRIPTOR_HEADROOM``). SEQPACKET delivers a message whole and only its
    ticket is read, so no partial message is ever buffered here.
    Whatever is refused, timed out or expired is closed at once.
    """

    def __init__(
        self,
        socket_path: str,
        allowed_uids: frozenset[int],
        max_fds_per_ticket: int = 1024,
        max_pending: int = 64,
        max_pending_per_uid: int = 8,
        max_pending_per_engine: int = 2,
        max_fds_per_uid: int = 4096,
        ticket_ttl_s: float = 60.0,
        connection_timeout_s: float = 2.0,
        max_connections: int = 64,
        on_received: Callable[[], None] | None = None,
    ) -> None:
        self.path = socket_path
        self.allowed_uids = allowed_uids
        self.max_fds_per_ticket = max_fds_per_ticket
        self.max_pending = max_pending
        self.max_pending_per_uid = max_pending_per_uid
        self.max_pending_per_engine = max_pending_per_engine
        self.max_fds_per_uid = max_fds_per_uid
        self.ticket_ttl_s = ticket_ttl_s
        self.connection_timeout_s = connection_timeout_s
        self.max_connections = max_connections
        self.on_received = on_received
        """Told (on the inbox's thread) after each message that carried descriptors: the
        connection guard's count of free ones is stale then."""
        self.refused = 0
        self._pending: dict[bytes, ReceivedFds] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1

    def start(self) -> None:
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, args=(sel,), name="kvcache-fd-inbox", daemon=True)
        self._thread.start()

    # -- the loop ----------------------------------------------------------------------

    def _loop(self, sel: selectors.BaseSelector) -> None:
        conns: dict[int, _Conn] = {}  # by fileno, in accept order (oldest first)
        with sel:
            try:
                while not self._stop.is_set():
                    now = time.monotonic()
                    timeout = min([c.deadline for c in conns.values()], default=now + 1.0) - now
                    for key, _ in sel.select(max(0.0, min(timeout, 1.0))):
                        if key.fileobj is self._sock:
                            self._accept(sel, conns)
                        elif key.fileobj == self._wake_r:
                            continue
                        else:
                            conn = conns.get(key.fd)
                            if conn is not None and self._serve(conn.sock):
                                self._drop(sel, conns, key.fd)
                    now = time.monotonic()
                    for fileno in [f for f, c in conns.items() if c.deadline <= now]:
                        log.info("fd socket: dropped a connection that sent nothing in time")
                        self._drop(sel, conns, fileno)
                    with self._lock:
                        self._expire(now)
            finally:
                for fileno in list(conns):
                    self._drop(sel, conns, fileno)

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, _Conn]) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the others are still served
                log.warning("fd socket: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(conns) >= self.max_connections:
                log.warning("fd socket: %d connections open; dropping the oldest", len(conns))
                self._drop(sel, conns, next(iter(conns)))
            conns[sock.fileno()] = _Conn(sock, time.monotonic() + self.connection_timeout_s)
            sel.register(sock, selectors.EVENT_READ)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, conns: dict[int, _Conn], fileno: int) -> None:
        conn = conns.pop(fileno)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        conn.sock.close()

    def _serve(self, conn: socket.socket) -> bool:
        """One hand-over (the message is there); never raises, never keeps a descriptor it
        refused. False when there was nothing to read after all (the connection stays)."""
        fds: list[int] = []
        try:
            pid, uid, _ = trusted_dir.peer_cred(conn)
            # Read first, refuse after: closing with a message unread resets the
            # connection, and the peer would never see why it was refused.
            ticket, fds = self._receive(conn)
            if uid not in self.allowed_uids:
                raise AccessDeniedError(f"uid {uid} may not hand memory to this daemon")
            sizes = [_checked_size(fd) for fd in fds]
            self._keep(ticket, ReceivedFds(fds, sizes, uid, pid))
            fds = []  # kept: no longer ours to close
            reply = FdReply()
        except (BlockingIOError, InterruptedError):
            return False
        except (AccessDeniedError, LimitExceededError, LayoutError) as exc:
            self.refused += 1
            log.warning("fd socket: refused a hand-over: %s", exc)
            reply = FdReply(code=refusal_code(exc), message=str(exc))
        except OSError as exc:  # peer gone: nothing to answer
            log.info("fd socket: dropped a connection: %s", exc)
            return True
        except Exception:  # a bug here must not stop the inbox for everyone else
            log.exception("fd socket: internal error serving a hand-over")
            return True
        finally:
            _close_all(fds)
        with contextlib.suppress(OSError):  # a few bytes into an empty buffer: never blocks
            conn.send(msgspec.msgpack.encode(reply), socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
        return True

    def _receive(self, conn: socket.socket) -> tuple[bytes, list[int]]:
        # Room for no more descriptors than the process can spare: the kernel installs them
        # before any check here, and a process out of descriptors loses its ipc:// listener
        # (``connections``). Those that do not fit are discarded by the kernel (MSG_CTRUNC).
        free = free_descriptors()
        room = self.max_fds_per_ticket
        if free is not None:
            room = min(room, free - DESCRIPTOR_HEADROOM)
        msg, ancdata, flags, _ = conn.recvmsg(
            MAX_TICKET + 1,
            socket.CMSG_SPACE(room * FD_SIZE) if room > 0 else 0,
            socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT,
        )
        if not msg and not ancdata and not flags:
            raise ConnectionResetError("the peer left without sending anything")
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(data[: len(data) - len(data) % FD_SIZE])
                fds += list(arr)
        if fds and self.on_received is not None:
            self.on_received()
        try:
            if (flags & socket.MSG_CTRUNC or len(fds) > room) and room < self.max_fds_per_ticket:
                raise LimitExceededError(
                    f"the daemon is short of descriptors ({free} free, {DESCRIPTOR_HEADROOM} kept "
                    "in reserve); try again later, or raise its `ulimit -n`"
                )
            if flags & socket.MSG_CTRUNC or len(fds) > self.max_fds_per_ticket:
                raise LimitExceededError(f"more than {self.max_fds_per_ticket} descriptors in one hand-over")
            if flags & socket.MSG_TRUNC or not MIN_TICKET <= len(msg) <= MAX_TICKET:
                raise LayoutError(f"a ticket is {MIN_TICKET}..{MAX_TICKET} bytes")
            if not fds:
                raise LayoutError("a hand-over must carry at least one descriptor")
        except BaseException:
            _close_all(fds)
            raise
        return bytes(msg), fds

    # -- tickets -----------------------------------------------------------------------

    def _keep(self, ticket: bytes, received: ReceivedFds) -> None:
        now = time.monotonic()
        received.expires = now + self.ticket_ttl_s
        with self._lock:
            self._expire(now)
            if ticket in self._pending:
                raise AccessDeniedError("that ticket is already in use")
            mine = [r for r in self._pending.values() if r.uid == received.uid]
            # An engine registers right after its hand-over, so it has one pending at a time
            # (two while it retries); a process piling them up is stuck or hostile, and it
            # must not use up the quota its user's other engines register with.
            engine = sum(1 for r in mine if r.pid == received.pid)
            if engine >= self.max_pending_per_engine:
                raise LimitExceededError(
                    f"process {received.pid} already has {engine} hand-overs waiting to be "
                    "registered; register them (or let them expire) first"
                )
            if len(mine) >= self.max_pending_per_uid:
                raise LimitExceededError(
                    f"uid {received.uid} already has {len(mine)} hand-overs waiting to be registered"
                )
            if sum(len(r.fds) for r in mine) + len(received.fds) > self.max_fds_per_uid:
                raise LimitExceededError(
                    f"uid {received.uid} would hold more than {self.max_fds_per_uid} descriptors "
                    "waiting to be registered"
                )
            if len(self._pending) >= self.max_pending:
                raise LimitExceededError(f"{self.max_pending} hand-overs are waiting to be registered")
            self._pending[ticket] = received

    def _expire(self, now: float) -> None:
        """Close and drop the tickets past their time (the caller holds the lock)."""
        for ticket in [t for t, r in self._pending.items() if r.expires <= now]:
            self._pending.pop(ticket).close()

    def take(self, ticket: bytes) -> ReceivedFds:
        """The descriptors handed over under ``ticket`` (now the caller's to close);
        ``AccessDeniedError`` for a ticket unknown, already taken or expired."""
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
        """Stop the thread, close every open connection and pending descriptor, unlink."""
        self._stop.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r, self._wake_w = -1, -1
        with self._lock:
            for received in self._pending.values():
                received.close()
            self._pending.clear()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _checked_size(fd: int) -> int:
    """The size of ``fd`` if it is a memfd sealed against shrinking; ``LayoutError`` if not.

    The seals are read before the size: read the other way round, a peer could shrink an
    unsealed memfd between the two reads and seal it after, and the daemon would trust a size
    larger than the memory (SIGBUS on the first copy past the end)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a sealable file (disk files, pipes, sockets)
    # Only memfds (and hugetlbfs ones) take seals; other shmem files (/dev/shm) report
    # F_SEAL_SEAL alone, never F_SEAL_SHRINK.
    if not seals & fcntl.F_SEAL_SHRINK:
        raise LayoutError(
            "a handed-over descriptor is not a memfd sealed against shrinking; allocate CPU KV "
            "tensors with kvcache.client.empty_shared"
        )
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise LayoutError("a handed-over descriptor is not a memory file")
    return st.st_size


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


__all__ = ["FdInbox"]
