"""What a client checks about its daemon before trusting it (issue 20, finding 5).

The daemon must run as an expected uid (``expected_daemon_uid``). ``DaemonTrust`` holds
the checks for one endpoint: an ``ipc://`` endpoint's directory must be a private directory of
that uid (``kvcache.trusted_dir``), and memfds go only to the fd socket in that directory,
never to a path a reply names. ``DaemonUidCheck`` checks the uid of the process behind every
``ipc://`` connection, before any request leaves:

libzmq runs the ZAP handshake (RFC 27) on whichever end of a connection sets
``ZMQ_ZAP_DOMAIN``, the connecting end included, and for an ``ipc://`` peer it appends the
uid it read with ``SO_PEERCRED`` to the address it reports (``host:uid:gid:pid``). So a
client DEALER with a domain set asks this handler about every connection it makes (one per
socket: the channel opens a new socket to reconnect, as libzmq aborts the process when it
reconnects a ZAP-checked socket at the wrong moment; ``protocol.channel``), and a refused one
never completes its handshake: a process of another uid behind the socket receives no
request (no token ids, no registration ticket), and the client learns of it as
``HANDSHAKE_FAILED_AUTH``.

Chosen over a socket monitor's ``EVENT_CONNECTED`` descriptor, which is reported after
the connection is already usable (a queued request could leave before the check), and over
checking the socket file's owner alone, which says nothing about the process that listens.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Any

import zmq

from kvcache.errors import DaemonUnavailableError, UntrustedPathError
from kvcache.trusted_dir import check_private_dir, ipc_peer_pid, ipc_peer_uid

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvcache-daemon"


FD_SOCKET_NAME = "fds.sock"
_WATCHED_DAEMONS = 4  # daemon processes watched at once: the current one and a few before it


def expected_daemon_uid(daemon_uid: int | None = None) -> int:
    """The uid the daemon must run as: ``daemon_uid``, else ``$KVCACHE_DAEMON_UID``, else this
    process's own (a daemon of the same user, the default setup)."""
    if daemon_uid is None:
        raw = os.environ.get("KVCACHE_DAEMON_UID", "")
        if not raw:
            return os.getuid()
        if not raw.isdigit():
            raise ValueError(f"KVCACHE_DAEMON_UID must be a uid (a non-negative integer), got {raw!r}")
        daemon_uid = int(raw)
    if isinstance(daemon_uid, bool) or not isinstance(daemon_uid, int) or daemon_uid < 0:
        raise ValueError(f"daemon_uid must be a non-negative integer, got {daemon_uid!r}")
    return daemon_uid


class DaemonTrust:
    """The checks for one endpoint and daemon uid. ``runtime_dir``: the directory of an
    ``ipc://`` endpoint's socket (None for TCP). Made, it has checked that directory if it
    exists yet (``UntrustedPathError``; a daemon not started yet is no error)."""

    def __init__(self, endpoint: str, uid: int) -> None:
        self.endpoint, self.uid = endpoint, uid
        self.runtime_dir: str | None = None
        if endpoint.startswith("ipc://"):
            self.runtime_dir = os.path.dirname(os.path.abspath(endpoint[len("ipc://") :]))
            if os.path.lexists(self.runtime_dir):
                self.check_dir(self.runtime_dir, f"not connecting to {endpoint}")

    def check_dir(self, path: str, doing: str) -> None:
        """``UntrustedPathError`` unless ``path`` is a private directory of the daemon's uid
        (the message starts with ``doing``); ``DaemonUnavailableError`` if it is missing."""
        try:
            check_private_dir(path, self.uid, "the daemon's runtime directory")
        except UntrustedPathError as exc:
            raise UntrustedPathError(f"{doing}: {exc}") from None
        except FileNotFoundError:
            raise DaemonUnavailableError(f"{doing}: {path} does not exist; is the daemon running?") from None

    def fd_socket(self, named: str) -> str:
        """Where to hand memfds over, ``named`` being the path the daemon's reply names:
        ``fds.sock`` in the ``ipc://`` endpoint's directory, whatever the reply says. Over TCP
        there is no directory of the endpoint's own, nor a peer uid to check, so ``named`` is
        used, but only if it is an absolute ``.../fds.sock`` whose directory passes the same
        check. Either way the listener's uid is checked when connecting (``send_fds``)."""
        path = named if self.runtime_dir is None else os.path.join(self.runtime_dir, FD_SOCKET_NAME)
        if os.path.basename(path) != FD_SOCKET_NAME or not os.path.isabs(path):
            raise UntrustedPathError(f"not handing memfds to {path!r}: not an absolute path to fds.sock")
        self.check_dir(os.path.dirname(path), f"not handing memfds to {path}")
        return path

    def peer_check(self, context: zmq.Context[Any]) -> DaemonUidCheck | None:
        """The ZAP handler that checks every ``ipc://`` connection's peer (None for TCP,
        which has no peer credentials)."""
        return DaemonUidCheck(context, self.uid) if self.runtime_dir is not None else None


class DaemonUidCheck:
    """Answers the ZAP requests of ``context`` (one per context: the endpoint is fixed):
    an ``ipc://`` peer is accepted only if it runs as ``uid``. ``sockopts`` are what a
    DEALER sets to be checked; ``refusal`` says why the last connection was refused.

    It also watches the daemon's process: ``pid`` is the one last approved, and ``exited``
    tells whether a given one has ended (a pidfd, opened while its connection was being
    approved, so a reused pid is never mistaken for it). A call sent to a daemon that exited
    can never be answered, and nothing of it is still being copied: the client fails it at
    once instead of at its timeout (``Channel.daemon_exited``)."""

    def __init__(self, context: zmq.Context[Any], uid: int) -> None:
        self.uid = uid
        self.refusal: str | None = None
        self.pid: int | None = None
        """The daemon process last approved (None before, or where pids are not visible)."""
        self._pidfds: dict[int, int] = {}  # the last few daemons' processes (restarts)
        self._pid_lock = threading.Lock()
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._wake_addr = f"inproc://kvcache-peer-check-{id(self)}"
        self._wake = context.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_addr)
        self._stopper = context.socket(zmq.PAIR)
        self._stopper.setsockopt(zmq.LINGER, 0)
        self._stopper.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name="kvcache-peer-check", daemon=True)
        self._thread.start()

    @property
    def sockopts(self) -> dict[int, int | bytes]:
        """Options of a DEALER whose connections this handler must approve; with
        ``ZAP_ENFORCE_DOMAIN`` a connection made while no handler answers fails too."""
        return {zmq.ZAP_DOMAIN: ZAP_DOMAIN, zmq.ZAP_ENFORCE_DOMAIN: 1}

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake in ready:
                return
            self._sock.send_multipart(self._answer(self._sock.recv_multipart()))

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, *_ = msg
        peer = address.decode(errors="replace")
        uid = ipc_peer_uid(peer)
        if uid == self.uid:
            self._watch(ipc_peer_pid(peer))
            return [version, request_id, b"200", b"OK", b"", b""]
        self.refusal = (
            f"the process listening there runs as uid {uid}, not as the expected daemon uid "
            f"{self.uid} (peer {peer}): another user may have planted it. Start the daemon "
            "as that user, or set KVCACHE_DAEMON_UID / daemon_uid to the daemon's uid"
            if uid is not None
            else f"no peer credentials for {peer}"
        )
        return [version, request_id, b"400", self.refusal.encode(), b"", b""]

    def _watch(self, pid: int | None) -> None:
        """Watch the daemon process just approved: ``pid`` is its, with a pidfd that is its.

        A pidfd already held under ``pid`` belongs to the process that had it before when
        that one has exited: the kernel hands pids out again (a restarted daemon in a small
        pid space), so it is replaced, or a connection the live daemon drops would fail its
        calls as lost. Where no pidfd can be opened (pid 0: another pid namespace; the
        process gone already; no pidfd or no descriptor left) the daemon is unknown
        (``pid`` None), never the one before it, which may have exited."""
        with self._pid_lock:
            self.pid = pid if pid and self._pidfd(pid) is not None else None

    def _pidfd(self, pid: int) -> int | None:
        """The pidfd of the process that has ``pid`` now, opened if needed (lock held)."""
        fd = self._pidfds.get(pid)
        if fd is not None and _ended(fd):
            os.close(self._pidfds.pop(pid))
            fd = None
        if fd is None:
            try:
                fd = self._pidfds[pid] = os.pidfd_open(pid)
            except (OSError, AttributeError):
                return None
            while len(self._pidfds) > _WATCHED_DAEMONS:
                os.close(self._pidfds.pop(next(iter(self._pidfds))))
        return fd

    def exited(self, pid: int | None, wait_s: float = 0.0) -> bool:
        """Whether the daemon process ``pid`` (one this handler approved) has ended, waiting
        up to ``wait_s`` for it; False when it cannot tell."""
        with self._pid_lock:
            fd = self._pidfds.get(pid) if pid else None
            return fd is not None and _ended(fd, wait_s)

    def close(self) -> None:
        """Stop the thread and close the sockets (before the context is terminated)."""
        self._stopper.send(b"")
        self._thread.join()
        for sock in (self._sock, self._wake, self._stopper):
            sock.close(linger=0)
        with self._pid_lock:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()


def _ended(pidfd: int, wait_s: float = 0.0) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd turns readable then), waiting up
    to ``wait_s`` for it."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(max(0, round(wait_s * 1000))))


__all__ = ["FD_SOCKET_NAME", "ZAP_DOMAIN", "DaemonTrust", "DaemonUidCheck", "expected_daemon_uid"]
