"""Hostile neighbours (issue 20, findings 2 and 3): connection floods and stalled frames.

Observed before, against a real daemon: (2) a thousand idle connections to the loopback TCP
port, under a descriptor limit of 1024, made the next Unix-socket connection abort the
daemon inside libzmq ("Too many open files", SIGABRT); (3) a frame announced just under the
old hard cap (twice --max-message-mb) and never finished held that much memory per
connection, with no bound across connections. Each test plays the hostile peer with plain
sockets (``zmtp``) while an engine of another tenant keeps being served over ipc://.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds

from . import zmtp
from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))
MiB = 1 << 20


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


@contextmanager
def _tenant(d: DaemonProcess, instance: int) -> Iterator[tuple[KVCacheClient, list[torch.Tensor]]]:
    """An engine on the Unix socket that has stored its prefix; ``_served`` checks it."""
    kv = _cache(instance)
    with KVCacheClient(d.ipc_endpoint, instance, f"tenant-{instance}", timeout_s=10) as c:
        c.register_kv_caches(kv)
        c.store(TOKENS, BLOCKS)
        yield c, kv


def _served(client: KVCacheClient, kv: list[torch.Tensor]) -> None:
    """The tenant's prefix comes back byte-exact (its engine blocks zeroed first)."""
    want = clone_caches(kv)
    for t in kv:
        t.zero_()
    assert client.retrieve(TOKENS, BLOCKS) == 64 and caches_equal(kv, want)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _answers_ping(sock: socket.socket, blurted: bool = False) -> bool:
    """Handshake, one Ping, its Pong: False when the daemon closes the connection instead.
    ``blurted``: the greeting and READY went out already (``zmtp.blurt``)."""
    try:
        if blurted:
            zmtp.after_blurt(sock)
        else:
            zmtp.handshake(sock)
        frame = encode_request(7, m.Ping())
        sock.sendall(zmtp.frame_header(len(frame)) + frame)
        while True:
            flags, body = zmtp.read_frame(sock)
            if not flags & 0x04:  # not a command (a heartbeat PING): the reply
                return isinstance(decode_reply(body).body, m.Pong)
    except (ConnectionError, TimeoutError):
        return False


# -- finding 2: descriptors and connections -------------------------------------------------


def test_a_thousand_idle_connections_under_a_1024_descriptor_limit_do_not_kill_the_daemon(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """The issue's attack as reported, against the default caps."""
    d = start_daemon(nofile=(1024, 1024), tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        flood = zmtp.flood(d.endpoint, 1100)  # more than the descriptor table holds
        try:
            # A new engine on the Unix socket: the connection that used to abort the daemon.
            with KVCacheClient(d.ipc_endpoint, 2, "newcomer", timeout_s=10) as newcomer:
                newcomer.register_kv_caches(_cache(2))
                assert newcomer.lookup(TOKENS) == 0
            _served(tenant, kv)
        finally:
            for s in flood:
                s.close()
        assert d.proc.poll() is None


def test_the_descriptor_soft_limit_is_raised_to_the_hard_limit(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon(nofile=(1024, 4096), tcp=True)
    with open(f"/proc/{d.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line


def test_connections_are_capped_in_total_and_per_client(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-connections", "12", "--max-connections-per-client", "6", tcp=True)
    with _tenant(d, 1) as (tenant, kv):  # two connections of uid:N, made before the flood
        flood = zmtp.flood(d.endpoint, 8)  # past the cap the listener may be shut: fewer
        try:
            answered = sum(_answers_ping(s) for s in flood)
            assert answered == 6  # the rest were closed or never accepted: loopback is full
            with KVCacheClient(d.ipc_endpoint, 2, "newcomer", timeout_s=10) as newcomer:
                newcomer.register_kv_caches(_cache(2))  # another client still gets in
                newcomer.store(TOKENS, BLOCKS)
            _served(tenant, kv)
        finally:
            for s in flood:
                s.close()
        # Closed connections give their slots back.
        again = [zmtp.connect(d.endpoint, timeout_s=10) for _ in range(6)]
        try:
            assert all(_answers_ping(s) for s in again)
        finally:
            for s in again:
                s.close()
    assert d.proc.poll() is None


@contextmanager
def _busy(client: KVCacheClient) -> Iterator[None]:
    """The tenant looks up long prompts without pause meanwhile: the daemon's Python threads
    take turns at the interpreter lock, as on a loaded daemon."""
    stop = threading.Event()
    prompt = list(range(1 << 16))

    def hammer() -> None:
        while not stop.is_set():
            client.lookup(prompt)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_connection_over_the_cap_is_never_served_however_fast_it_speaks(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Forty peers connect at once, each writing its greeting and READY without waiting and
    its Ping the moment the daemon's READY arrives, so a request reaches the I/O loop a round
    trip after its accept. No peer past the per-client cap may be answered: the cap is
    checked before a connection's first request is read, not some time after its accept."""
    d = start_daemon("--max-connections", "12", "--max-connections-per-client", "6", tcp=True)
    flood: list[socket.socket] = []
    with _tenant(d, 1) as (tenant, _), _busy(tenant):
        for _ in range(40):
            try:
                sock = zmtp.connect(d.endpoint, timeout_s=2)
            except TimeoutError:  # the listener is shut while loopback is full
                break
            flood.append(sock)
            with contextlib.suppress(OSError):
                zmtp.blurt(sock)
        try:
            with ThreadPoolExecutor(len(flood)) as pool:
                answered = sum(pool.map(functools.partial(_answers_ping, blurted=True), flood))
        finally:
            for s in flood:
                s.close()
    assert answered == 6, f"{answered} of {len(flood)} connections served; the cap is 6"
    assert d.proc.poll() is None


def test_connections_closed_as_soon_as_made_never_stop_the_daemon(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Connections opened and closed at once, by the thousand: libzmq may close one while the
    guard reads its peer (on the I/O thread now), which once raised out of the loop that
    serves every client. The tenant is served all along and after."""
    d = start_daemon(tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        for endpoint in (d.ipc_endpoint, d.endpoint) * 500:
            with contextlib.suppress(OSError):
                zmtp.connect(endpoint, timeout_s=2).close()
        _served(tenant, kv)
        assert _answers_ping(zmtp.connect(d.endpoint, timeout_s=10))
    assert d.proc.poll() is None


def test_a_local_user_is_held_to_its_own_cap_on_the_unix_socket(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-connections", "12", "--max-connections-per-client", "6", tcp=True)
    flood = [zmtp.connect(d.ipc_endpoint, timeout_s=10) for _ in range(10)]
    try:
        assert sum(_answers_ping(s) for s in flood) == 6  # uid:N, counted by SO_PEERCRED
        flood.append(zmtp.connect(d.endpoint, timeout_s=10))
        assert _answers_ping(flood[-1])  # loopback TCP is another client, with its own cap
    finally:
        for s in flood:
            s.close()


def test_a_connection_that_never_finishes_its_handshake_is_closed(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--handshake-timeout", "0.5", tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        silent = zmtp.connect(d.endpoint, timeout_s=10)
        half = zmtp.connect(d.endpoint, timeout_s=10)
        half.sendall(b"\xff" + bytes(8))  # the start of a greeting, then nothing
        try:
            assert zmtp.wait_closed(silent) and zmtp.wait_closed(half)
        finally:
            silent.close()
            half.close()
        _served(tenant, kv)


def test_a_peer_that_stops_answering_heartbeats_is_closed(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--peer-heartbeat", "0.2", tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        mute = zmtp.connect(d.endpoint, timeout_s=10)
        try:
            zmtp.handshake(mute)
            assert zmtp.wait_closed(mute)  # pinged, never answered
        finally:
            mute.close()
        _served(tenant, kv)  # libzmq clients answer the pings and stay


def test_a_registration_that_would_use_up_the_descriptors_is_refused(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Each mapped CPU tensor keeps a descriptor: 800 views of one memfd under a limit of
    1024, then a few idle connections, used to leave the ipc:// listener nothing."""
    d = start_daemon(nofile=(1024, 1024), tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        pong = raw_call(d.ipc_endpoint, m.Ping())
        assert isinstance(pong, m.Pong)
        memory = memfd.empty_shared((1024,), torch.float16)
        _, fds = memfd.export_cpu_tensors([memory])
        ticket = secrets.token_bytes(16)
        send_fds(pong.fd_socket, ticket, fds, 5)
        view = m.FdTensor(fd_index=0, offset=0, shape=[2, 4, 4, 2, 8], stride=[256, 64, 16, 8, 1],
                          dtype="float16")  # fmt: skip
        reply = raw_call(d.ipc_endpoint, m.Register(instance_id=3, model_name="greedy",
                                                    tensors=[view] * 800, fd_ticket=ticket))  # fmt: skip
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LIMIT, reply
        assert "short of descriptors" in reply.message
        flood = zmtp.flood(d.endpoint, 200)  # what is left, taken
        try:
            with KVCacheClient(d.ipc_endpoint, 2, "newcomer", timeout_s=10) as newcomer:
                newcomer.register_kv_caches(_cache(2))
            _served(tenant, kv)
        finally:
            for s in flood:
                s.close()
    assert d.proc.poll() is None


# -- finding 3: unfinished frames ------------------------------------------------------------


def test_a_frame_announced_beyond_the_message_cap_closes_its_connection_at_once(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-message-mb", "1", tcp=True)
    with _tenant(d, 1) as (tenant, kv):
        stalled = zmtp.connect(d.endpoint, timeout_s=5)
        try:
            zmtp.handshake(stalled)
            # Just under the old hard cap (2 x 1 MiB + 4096), all but the last byte.
            with contextlib.suppress(ConnectionError):  # closed while sending: as it should
                stalled.sendall(zmtp.frame_header(2 * MiB) + bytes(2 * MiB - 1))
            assert zmtp.wait_closed(stalled), "the daemon still waits for the rest of the frame"
        finally:
            stalled.close()
        at_cap = zmtp.connect(d.endpoint, timeout_s=10)
        try:  # a frame of exactly the cap is still read, and answered with a typed error
            zmtp.handshake(at_cap)
            at_cap.sendall(zmtp.frame_header(MiB) + b"\xc1" * MiB)
            while (frame := zmtp.read_frame(at_cap))[0] & 0x04:
                pass  # heartbeat commands
            reply = decode_reply(frame[1]).body
            assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_MESSAGE, reply
        finally:
            at_cap.close()
        _served(tenant, kv)
    assert d.proc.poll() is None


def test_memory_held_by_unfinished_frames_is_bounded_across_connections(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    cap, per_client = 4, 8  # MiB per frame, connections per client
    d = start_daemon("--max-message-mb", str(cap), "--max-connections", "16",
                     "--max-connections-per-client", str(per_client), tcp=True)  # fmt: skip
    with _tenant(d, 1) as (tenant, kv):
        before = _rss(d.pid)
        stalled: list[socket.socket] = []
        try:
            for _ in range(per_client + 2):
                try:
                    s = zmtp.connect(d.endpoint, timeout_s=2)
                except TimeoutError:
                    continue  # refused: the listener is shut while loopback is full
                stalled.append(s)
                try:
                    zmtp.handshake(s)
                    s.sendall(zmtp.frame_header(cap * MiB) + os.urandom(cap * MiB - 1))
                except ConnectionError:
                    continue  # refused: over the per-client cap
            _served(tenant, kv)
            grown = _rss(d.pid) - before
            # per_client frames of cap MiB at most (2 more were attempted), with slack
            # for the tenant's retrieve and the allocator.
            assert grown < (per_client * cap + 16) * MiB, grown / MiB
        finally:
            for s in stalled:
                s.close()
    assert d.proc.poll() is None
