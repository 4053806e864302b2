"""The fd socket against careless and hostile peers: only sealed memfds, bounded, never stuck."""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError
from kvcache.server import ipc
from kvcache.server.fdpass import FdInbox, send_fds


def _fds_open() -> set[tuple[str, str]]:
    """(fd, target) of this process's open descriptors but sockets (the inbox may still be
    closing its end of a connection): a leaked memfd, file or pipe shows as a new entry."""
    out = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            out.add((entry, target))
    return out


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[FdInbox]:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), max_fds_per_ticket=8,
                  max_pending=4, connection_timeout_s=0.5)  # fmt: skip
    box.start()
    yield box
    box.close()


def _memfd(size: int = 64, seals: int = fcntl.F_SEAL_SHRINK) -> int:
    fd = os.memfd_create("kvcache-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_sealed_memfd_round_trips_with_its_size_and_sender(inbox: FdInbox) -> None:
    t = ipc.empty_shared((256,), torch.float32)
    _, fds = ipc.export_cpu_tensors([t])
    ticket = secrets.token_bytes(16)
    send_fds(inbox.path, ticket, fds, 5)
    received = inbox.take(ticket)
    assert received.sizes == [1024] and received.uid == os.getuid() and received.pid == os.getpid()
    with pytest.raises(AccessDeniedError, match="unknown, used or expired"):
        inbox.take(ticket)  # one use only
    received.close()
    assert oct(os.stat(inbox.path).st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("kind", ["unsealed memfd", "regular file", "dev shm file", "pipe"])
def test_anything_but_a_shrink_sealed_memfd_is_refused(inbox: FdInbox, kind: str, tmp_path: Path) -> None:
    if kind == "unsealed memfd":
        fd = _memfd(seals=0)
    elif kind == "regular file":
        fd = os.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 64)
    elif kind == "dev shm file":
        path = f"/dev/shm/kvcache-test-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink(path)
    else:
        fd, w = os.pipe()
        os.close(w)
    before = _fds_open()
    with pytest.raises(LayoutError):
        send_fds(inbox.path, secrets.token_bytes(16), [fd], 5)
    assert not _fds_open() - before  # the daemon side closed its copy
    assert inbox.pending() == 0
    os.close(fd)


def test_a_peer_of_another_uid_is_refused(tmp_path: Path) -> None:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid() + 12345}))
    box.start()
    try:
        with pytest.raises(AccessDeniedError, match="uid"):
            send_fds(box.path, secrets.token_bytes(16), [_memfd()], 5)
        assert box.pending() == 0
    finally:
        box.close()


def test_too_many_descriptors_are_refused_and_closed(inbox: FdInbox) -> None:
    fds = [_memfd() for _ in range(20)]
    before = _fds_open()
    with pytest.raises(LimitExceededError, match="more than 8"):
        send_fds(inbox.path, secrets.token_bytes(16), fds, 5)
    assert not _fds_open() - before
    for fd in fds:
        os.close(fd)


def test_pending_tickets_are_bounded_and_expire(tmp_path: Path) -> None:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), max_pending=2)
    box.start()
    try:
        fd = _memfd()
        for _ in range(2):
            send_fds(box.path, secrets.token_bytes(16), [fd], 5)
        with pytest.raises(LimitExceededError, match="waiting"):
            send_fds(box.path, secrets.token_bytes(16), [fd], 5)
        box.ticket_ttl_s = 0.0  # everything pending is now past its time
        box._expire(float("inf"))
        assert box.pending() == 0
        send_fds(box.path, secrets.token_bytes(16), [fd], 5)  # room again
        os.close(fd)
    finally:
        box.close()


def test_a_silent_or_garbage_peer_does_not_block_others(inbox: FdInbox) -> None:
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(inbox.path)  # connects, never sends
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    garbage.connect(inbox.path)
    garbage.send(b"x" * 1000)  # no descriptors, oversized ticket
    assert b"layout" in garbage.recv(4096)
    ticket = secrets.token_bytes(16)
    send_fds(inbox.path, ticket, [_memfd()], 5)  # served while the silent peer still waits
    inbox.take(ticket).close()
    silent.close()
    garbage.close()


def test_short_tickets_are_refused(inbox: FdInbox) -> None:
    with pytest.raises(ValueError, match="ticket"):
        send_fds(inbox.path, b"short", [_memfd()], 5)


def test_a_live_socket_is_never_taken_over_but_a_stale_one_is(tmp_path: Path, inbox: FdInbox) -> None:
    with pytest.raises(OSError, match="another kvcache daemon"):
        FdInbox(inbox.path, frozenset({os.getuid()})).start()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: what a killed daemon leaves
    box = FdInbox(str(stale), frozenset({os.getuid()}))
    box.start()
    box.close()
    assert not stale.exists()
