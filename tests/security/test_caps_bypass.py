"""Attacks on the connection and message caps after issue 20.

Connection slots: unauthenticated TCP peers must not take the slots the daemon's own
engines need on its Unix socket. On CURVE TCP the per-client cap counts connections by
source address (``ip:ADDR``), which the guard reads before any handshake. A local user owns
every address of 127.0.0.0/8 (and a remote one may own many), so two source addresses, each
at the per-client cap, fill the total cap, and the daemon's own user can no longer connect
over ipc:// until the peers' handshake timeout (and they simply reconnect). The peers never
authenticate.

Message size: ``ZMQ_MAXMSGSIZE`` caps each frame, not a message. A peer that sends frames
flagged MORE and never the last one has every frame buffered by libzmq (a message's frames
reach the socket only once it is complete, and the receive high-water mark counts complete
messages only), so one connection holds as much memory as it cares to send.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess

from . import zmtp
from .test_connections import _answers_ping, _rss, _served, _tenant

MiB = 1 << 20


def _curve_daemon(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> DaemonProcess:
    for name in ("daemon", "tenant"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0
    public = (tmp_path / "tenant.key").read_text().split('public-key = "')[1].split('"')[0]
    (tmp_path / "clients.toml").write_text(f'[[client]]\nname = "tenant"\npublic_key = "{public}"\n')
    return start_daemon(
        "--curve-secret-key", str(tmp_path / "daemon.key_secret"),
        "--clients", str(tmp_path / "clients.toml"),
        "--max-connections", "4", "--max-connections-per-client", "2",
        "--handshake-timeout", "120",  # the flood must outlast the test, not the test race it
        tcp=True,
    )  # fmt: skip


def _from(source: str, endpoint: str) -> socket.socket | None:
    """A silent connection from ``source`` (an address of 127/8), or None when the daemon's
    listener ignored it (shut: the daemon counts itself full)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    sock.bind((source, 0))
    try:
        sock.connect((host, int(port)))
    except TimeoutError:
        sock.close()
        return None
    return sock


def test_unauthenticated_tcp_peers_cannot_lock_the_operator_out_of_the_unix_socket(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    d = _curve_daemon(start_daemon, tmp_path)
    held: list[socket.socket] = []
    try:
        for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"):
            sock = _from(source, d.endpoint)
            assert sock is not None, "the daemon stopped accepting before its cap"
            held.append(sock)
        # The daemon counts itself full once a fifth peer is ignored (listener shut) or shut
        # down: by then the four above are counted, none of them authenticated.
        probe = _from("127.0.0.4", d.endpoint)
        if probe is not None:
            held.append(probe)
            assert zmtp.wait_closed(probe), "a fifth unauthenticated peer was kept"
        # The daemon's own user, on its private Unix socket: a ZMTP handshake and one Ping.
        own = zmtp.connect(d.ipc_endpoint, timeout_s=10)
        try:
            assert _answers_ping(own), "the daemon's own engine was refused on ipc://"
        finally:
            own.close()
    finally:
        for sock in held:
            sock.close()
    assert d.proc.poll() is None


@pytest.mark.xfail(
    strict=True,
    reason="message cap: ZMQ_MAXMSGSIZE bounds each frame only; the frames of a multipart "
    "message that never ends are all buffered by libzmq, without limit",
)
def test_a_multipart_message_that_never_ends_is_held_to_the_message_cap(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-message-mb", "1", tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        before = _rss(d.pid)
        endless = zmtp.connect(d.endpoint, timeout_s=10)
        try:
            zmtp.handshake(endless)
            frame = zmtp.frame_header(MiB - 64, more=True) + bytes(MiB - 64)
            with contextlib.suppress(ConnectionError):  # closed on the way: as it should be
                for _ in range(96):  # 96 MiB, each frame under the cap, the message unfinished
                    endless.sendall(frame)
            # The kernel's socket buffers hold a few MiB at most: the rest reached the daemon.
            grown = _rss(d.pid) - before
            assert grown < 32 * MiB, f"one unfinished message holds {grown / MiB:.0f} MiB"
        finally:
            endless.close()
        _served(tenant, kv)
    assert d.proc.poll() is None
