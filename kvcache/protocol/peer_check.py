"""The client's check of who answers on ``ipc://``: the daemon's uid, before any request leaves.

libzmq runs the ZAP handshake (RFC 27) on whichever end of a connection sets
``ZMQ_ZAP_DOMAIN``, the connecting end included, and for an ``ipc://`` peer it appends the
uid it read with ``SO_PEERCRED`` to the address it reports (``host:uid:gid:pid``). So a
client DEALER with a domain set asks this handler about every connection it makes, ZMQ's
reconnections after a daemon restart too, and a refused one never completes its handshake:
a process of another uid behind the socket receives no request (no token ids, no
registration ticket), and the client learns of it as ``HANDSHAKE_FAILED_AUTH``.

Chosen over a socket monitor's ``EVENT_CONNECTED`` descriptor, which is reported after
the connection is already usable (a queued request could leave before the check), and over
checking the socket file's owner alone, which says nothing about the process that listens.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from kvcache.trusted_dir import ipc_peer_uid

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvcache-daemon"


class DaemonUidCheck:
    """Answers the ZAP requests of ``context`` (one per context: the endpoint is fixed):
    an ``ipc://`` peer is accepted only if it runs as ``uid``. ``sockopts`` are what a
    DEALER sets to be checked; ``refusal`` says why the last connection was refused."""

    def __init__(self, context: zmq.Context[Any], uid: int) -> None:
        self.uid = uid
        self.refusal: str | None = None
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
            return [version, request_id, b"200", b"OK", b"", b""]
        self.refusal = (
            f"the process listening there runs as uid {uid}, not as the expected daemon uid "
            f"{self.uid} (peer {peer}): another user may have planted it. Start the daemon "
            "as that user, or set KVCACHE_DAEMON_UID / daemon_uid to the daemon's uid"
            if uid is not None
            else f"no peer credentials for {peer}"
        )
        return [version, request_id, b"400", self.refusal.encode(), b"", b""]

    def close(self) -> None:
        """Stop the thread and close the sockets (before the context is terminated)."""
        self._stopper.send(b"")
        self._thread.join()
        for sock in (self._sock, self._wake, self._stopper):
            sock.close(linger=0)


__all__ = ["ZAP_DOMAIN", "DaemonUidCheck"]
