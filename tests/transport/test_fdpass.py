"""The fd socket against careless and hostile peers: only sealed memfds, bounded, never stuck."""

from __future__ import annotations

import fcntl
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError
from kvcache.protocol.messages import FdTensor
from kvcache.server import fdinbox
from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM, FreeEstimate
from kvcache.server.fdinbox import FdInbox
from kvcache.transport import memfd, tensors
from kvcache.transport.fdpass import send_fds
from kvcache.transport.fdproto import MAX_FDS_PER_MESSAGE


def _fds_open() -> set[tuple[str, str]]:
    """(fd, target) of this process's open descriptors but sockets (the inbox may still be
    closing its end of a connection) and anonymous inodes (the eventfds of ZMQ sockets that
    other tests' clients, still running, may open and close meanwhile): a leaked memfd,
    file or pipe shows as a new entry."""
    out = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if not target.startswith(("socket:", "anon_inode:")):
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
    t = memfd.empty_shared((256,), torch.float32)
    _, fds = memfd.export_cpu_tensors([t])
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


def test_a_hand_over_never_takes_the_descriptors_the_process_keeps_in_reserve(inbox: FdInbox) -> None:
    """Out of descriptors, libzmq's ipc:// listener aborts the process (issue 20, finding 2):
    the inbox refuses what would eat into the reserve, and the kernel closes the rest."""
    fds = [_memfd() for _ in range(4)]
    before = _fds_open()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + DESCRIPTOR_HEADROOM + 2, hard))
    try:
        with pytest.raises(LimitExceededError, match="short of descriptors"):
            send_fds(inbox.path, secrets.token_bytes(16), fds, 5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not _fds_open() - before and inbox.pending() == 0
    send_fds(inbox.path, secrets.token_bytes(16), fds, 5)  # room again
    assert inbox.pending() == 1
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


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_many_silent_peers_do_not_delay_a_good_one(tmp_path: Path) -> None:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), connection_timeout_s=5)
    box.start()
    silent = []
    try:
        for _ in range(20):  # more than any worker pool: each would hold a worker for 5 s
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(box.path)
            silent.append(s)
        ticket, fd = secrets.token_bytes(16), _memfd()
        began = time.monotonic()
        send_fds(box.path, ticket, [fd], 2)
        assert time.monotonic() - began < 1.0
        box.take(ticket).close()
        os.close(fd)
    finally:
        for s in silent:
            s.close()
        box.close()


def test_open_connections_are_bounded_oldest_dropped_first(tmp_path: Path) -> None:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), connection_timeout_s=30,
                  max_connections=4)  # fmt: skip
    box.start()
    conns = []
    try:
        for _ in range(10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(box.path)
            s.settimeout(3)
            conns.append(s)  # accepted in this order: the listen backlog is first in, first out
        # The six oldest were closed by the daemon (EOF), long before their 30 s timeout.
        assert [c.recv(16) for c in conns[:6]] == [b""] * 6
        ticket = secrets.token_bytes(16)
        send_fds(box.path, ticket, [_memfd()], 2)  # and a good peer still gets in
        box.take(ticket).close()
    finally:
        for s in conns:
            s.close()
        box.close()


def test_a_silent_peer_is_dropped_after_the_connection_timeout(inbox: FdInbox) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(inbox.path)
    s.settimeout(5)
    began = time.monotonic()
    assert s.recv(16) == b""  # closed without an answer: it said nothing
    assert time.monotonic() - began < 2.0  # connection_timeout_s=0.5 in the fixture
    s.close()


def test_tickets_expire_and_close_their_descriptors_without_any_traffic(tmp_path: Path) -> None:
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), ticket_ttl_s=0.3)
    box.start()
    try:
        fd = _memfd()
        before = _fds_open()
        ticket = secrets.token_bytes(16)
        send_fds(box.path, ticket, [fd], 5)
        assert box.pending() == 1 and _fds_open() - before  # the daemon holds a copy
        # Nobody calls take: the inbox's own loop closes the expired copy.
        assert _wait_for(lambda: not _fds_open() - before, 3.0)
        with pytest.raises(AccessDeniedError, match="expired"):
            box.take(ticket)
        os.close(fd)
    finally:
        box.close()


def test_received_descriptors_do_not_leak_into_child_processes(inbox: FdInbox) -> None:
    fd = _memfd()
    ticket = secrets.token_bytes(16)
    send_fds(inbox.path, ticket, [fd], 5)
    received = inbox.take(ticket)
    assert fcntl.fcntl(received.fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    received.close()
    os.close(fd)


def test_seals_are_read_before_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that shrinks an unsealed memfd and seals it while the daemon checks it must not
    leave the daemon with a size larger than the memory (the next copy would SIGBUS)."""
    fd = _memfd(size=1 << 16, seals=0)
    real_fstat, real_fcntl = os.fstat, fcntl.fcntl
    acted = []

    def peer_acts(first_call_on: int) -> None:
        if first_call_on == fd and not acted:
            acted.append(True)
            os.ftruncate(fd, 0)
            real_fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)

    def fstat(f: int) -> os.stat_result:
        result = real_fstat(f)
        peer_acts(f)
        return result

    def fcntl_(f: int, cmd: int, arg: Any = 0) -> Any:
        result = real_fcntl(f, cmd, arg)
        peer_acts(f)
        return result

    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setattr(fcntl, "fcntl", fcntl_)
    try:
        size = fdinbox._checked_size(fd)
    except LayoutError:
        pass  # refused: it was not sealed when the daemon looked
    else:
        assert size <= real_fstat(fd).st_size, "the daemon trusts a size the memfd no longer has"
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert acted


def test_a_missing_socket_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConnectionError, match="cannot reach the daemon's fd socket"):
        send_fds(str(tmp_path / "nobody.sock"), secrets.token_bytes(16), [0], 1)


def test_more_descriptors_than_the_kernel_passes_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LimitExceededError, match=str(MAX_FDS_PER_MESSAGE)):
        send_fds(str(tmp_path / "x.sock"), secrets.token_bytes(16), [0] * (MAX_FDS_PER_MESSAGE + 1), 1)


ENGINE = r"""
import fcntl, os, sys, msgspec, torch
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds
socket_path, ticket = sys.argv[1], bytes.fromhex(sys.argv[2])
base = memfd.empty_shared((4, 4096), torch.float32)         # 64 KiB: the view below crosses pages
base.copy_(torch.arange(base.numel(), dtype=torch.float32).view(base.shape))
view = base[1:3, 1000:3000]
descs, fds = memfd.export_cpu_tensors([view])
send_fds(socket_path, ticket, fds, 5)
print(msgspec.json.encode(descs[0]).decode(), flush=True)
assert sys.stdin.readline() == "written\n"
assert bool((view == -1).all()) and float(base[0, 0]) == 0.0  # sees the daemon's writes, only there
refused = []
for size in (0, 4096, 1 << 20):                          # shrink (SIGBUS before), grow
    try:
        os.ftruncate(fds[0], size)
    except PermissionError:
        refused.append(size)
print("refused", refused, flush=True)
view.fill_(5)
print("filled", flush=True)
sys.stdin.readline()                                     # stay alive until the daemon has read
"""


def test_round_trip_with_an_engine_process_that_tries_to_truncate(inbox: FdInbox) -> None:
    ticket = secrets.token_bytes(16)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, inbox.path, ticket.hex()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert engine.stdin is not None and engine.stdout is not None
        desc = msgspec.json.decode(engine.stdout.readline(), type=FdTensor)
        received = inbox.take(ticket)
        assert received.pid == engine.pid and received.uid == os.getuid()
        mapped = tensors.import_tensor(desc, received).tensor
        received.close()
        want = torch.arange(4 * 4096, dtype=torch.float32).view(4, 4096)[1:3, 1000:3000]
        assert torch.equal(mapped, want)  # the engine's bytes, through the daemon's mapping
        mapped.fill_(-1)
        engine.stdin.write("written\n")
        engine.stdin.flush()
        assert engine.stdout.readline() == "refused [0, 4096, 1048576]\n"  # sealed: EPERM
        assert engine.stdout.readline() == "filled\n"
        assert bool((mapped == 5).all())  # every page still there: no SIGBUS, and live bytes
        engine.stdin.write("done\n")
        engine.stdin.flush()
        assert engine.wait(10) == 0
    finally:
        engine.kill()
        engine.wait()


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as nobody")
def test_one_uid_flooding_tickets_never_blocks_another(tmp_path: Path) -> None:
    """A client that hands over descriptors and never registers fills only its own quota:
    another uid's hand-over is still taken (before, 64 pending tickets of one uid refused all)."""
    import tempfile

    home = tempfile.mkdtemp(prefix="kvcache-fd-quota-", dir="/tmp")
    os.chmod(home, 0o755)
    box = FdInbox(os.path.join(home, "fds.sock"), frozenset({os.getuid(), NOBODY}),
                  max_fds_per_ticket=8, max_pending=8, max_pending_per_uid=3,
                  max_pending_per_engine=8)  # fmt: skip
    box.start()
    os.chmod(box.path, 0o777)
    try:
        pid = os.fork()
        if pid == 0:  # the flooder, as nobody: quota then refusals
            code = 0
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                fd = _memfd()
                for _ in range(3):
                    send_fds(box.path, secrets.token_bytes(16), [fd] * 8, 5)
                for _ in range(5):
                    try:
                        send_fds(box.path, secrets.token_bytes(16), [fd] * 8, 5)
                        code = 4  # taken beyond its quota
                    except LimitExceededError:
                        pass
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert box.pending() == 3
        fd = _memfd()
        ticket = secrets.token_bytes(16)
        send_fds(box.path, ticket, [fd], 5)  # another uid: still served
        box.take(ticket).close()
        os.close(fd)
    finally:
        box.close()
        os.rmdir(home)


def test_a_hand_over_makes_the_connection_guards_descriptor_count_stale(tmp_path: Path) -> None:
    """The guard counts free descriptors at most every 0.25 s and subtracts only the
    connections it accepted since: a hand-over of hundreds of descriptors in between left
    it that many too high, so it could admit connections into the reserve."""
    estimate = FreeEstimate(every_s=3600.0)  # counted once, then trusted for the test's length
    before = estimate.free()
    assert before is not None
    box = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}), max_fds_per_ticket=512,
                  on_received=estimate.stale)  # fmt: skip
    box.start()
    try:
        fds = [_memfd() for _ in range(200)]
        ticket = secrets.token_bytes(16)
        send_fds(box.path, ticket, fds, 5)
        for fd in fds:
            os.close(fd)
        received = box.take(ticket)
        try:
            after = estimate.free()
            assert after is not None and after <= before - 200, (before, after)
        finally:
            received.close()
    finally:
        box.close()
