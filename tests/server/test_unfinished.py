"""``UnfinishedMessages`` on a real loopback TCP connection: the kernel's byte count, and the
rule that cuts a connection receiving more than a message without delivering one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from kvcache.server.connections import ConnectionGuard, ConnectionLimits, _borrow
from kvcache.server.unfinished import UnfinishedMessages, bytes_received
from tests.security import zmtp

MiB = 1 << 20


@contextmanager
def _pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(sender, receiver): a connected loopback TCP pair."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MiB)  # fixed: the limit counts it
    with sender, receiver:
        yield sender, receiver


def _move(sender: socket.socket, receiver: socket.socket, n: int) -> None:
    """Send ``n`` bytes and read them all on the other end (as libzmq reads a connection)."""
    thread = threading.Thread(target=sender.sendall, args=(bytes(n),))
    thread.start()
    left = n
    while left:
        left -= len(receiver.recv(min(left, MiB)))
    thread.join()


def test_the_kernel_counts_what_a_tcp_connection_received() -> None:
    with _pair() as (sender, receiver):
        before = bytes_received(receiver)
        assert before is not None
        _move(sender, receiver, 3 * MiB + 5)
        assert bytes_received(receiver) == before + 3 * MiB + 5
    unix, other = socket.socketpair()
    with unix, other:
        assert bytes_received(unix) is None  # no counter on a Unix socket: not watched


def test_a_connection_past_a_message_without_delivering_one_is_over_and_forgotten() -> None:
    watch = UnfinishedMessages(max_message_bytes=MiB)
    with _pair() as (sender, receiver):
        fd = receiver.fileno()
        watch.watch(fd, receiver)
        _move(sender, receiver, watch.limit(receiver) + MiB)
        watch.snapshot(fd, receiver)
        reason = watch.over(fd, receiver)
        assert reason is not None and "never ends" in reason
        assert watch.fds == []  # cut once


def test_a_connection_that_delivered_since_the_last_check_starts_afresh() -> None:
    watch = UnfinishedMessages(max_message_bytes=MiB)
    with _pair() as (sender, receiver):
        fd = receiver.fileno()
        watch.watch(fd, receiver)
        for _ in range(3):  # each round more than the limit, each with a request delivered
            _move(sender, receiver, watch.limit(receiver) + MiB)
            watch.snapshot(fd, receiver)
            watch.delivered(fd)
            assert watch.over(fd, receiver) is None
        _move(sender, receiver, MiB)  # then one message's worth, and nothing delivered
        watch.snapshot(fd, receiver)
        assert watch.over(fd, receiver) is None
        assert watch.fds == [fd]


def test_a_descriptor_reused_by_a_fresh_connection_before_the_cut_is_left_alone() -> None:
    """The snapshot saw the old connection past the limit; by the judgement its descriptor
    holds a new connection (a fresh count): that one is not cut, and the mark is dropped."""
    watch = UnfinishedMessages(max_message_bytes=MiB)
    with _pair() as (sender, receiver), _pair() as (_, fresh):
        fd = receiver.fileno()
        watch.watch(fd, receiver)
        _move(sender, receiver, watch.limit(receiver) + MiB)
        watch.snapshot(fd, receiver)
        assert watch.over(fd, fresh) is None
        assert watch.fds == []


def test_a_message_that_ends_after_the_snapshot_is_not_counted_against_the_next() -> None:
    """Whole messages at the cap, back to back: the first ends between a check's snapshot and
    its read (a stalled I/O loop), the second is under way at the next check. Counting from
    the snapshot charged the second with the first's tail: two messages, and a cut."""
    watch = UnfinishedMessages(max_message_bytes=8 * MiB)
    with _pair() as (sender, receiver):
        fd = receiver.fileno()
        watch.watch(fd, receiver)
        watch.snapshot(fd, receiver)  # the first message has not begun to arrive
        _move(sender, receiver, 8 * MiB)  # ...then arrives whole before the loop reads it
        watch.delivered(fd)
        assert watch.over(fd, receiver) is None
        _move(sender, receiver, 8 * MiB - 1)  # the second, one byte short, at the next check
        watch.snapshot(fd, receiver)
        assert watch.over(fd, receiver) is None, "an honest peer's second message was cut"


def _accepted_on(fd: int, endpoint: str) -> bool:
    """Whether ``fd`` is a connection accepted on ``endpoint`` (libzmq's: never closed here)."""
    sock = _borrow(fd, endpoint)
    if sock is not None:
        sock.detach()
    return sock is not None


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_a_cut_never_lands_on_a_newcomer_that_took_the_closed_ones_descriptor() -> None:
    """A connection past the limit at a check's snapshot closes while the loop reads, and a
    new one gets its descriptor: the judgement (about the old one) must not shut the new."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    guard = ConnectionGuard(ConnectionLimits(), curve_tcp=False, max_message_bytes=MiB)
    guard.attach(ctx, router)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        endless = zmtp.connect(endpoint)
        zmtp.handshake(endless)
        guard.pump()  # watched from here
        [fd] = guard.watched
        frame = zmtp.frame_header(MiB - 64, more=True) + bytes(MiB - 64)
        for _ in range(64):  # past any limit (a receive buffer autotunes to 32 MiB at most)
            endless.sendall(frame)
        assert guard.tick()  # the snapshot: over the limit
        endless.close()
        assert _wait(lambda: not _accepted_on(fd, endpoint)), "libzmq kept the closed connection"
        newcomer = zmtp.connect(endpoint)
        zmtp.handshake(newcomer)
        assert _wait(lambda: _accepted_on(fd, endpoint)), "the descriptor was not reused"
        guard.cut_unfinished()
        newcomer.settimeout(0.5)
        assert not zmtp.wait_closed(newcomer), "the newcomer was cut for the old connection's bytes"
        newcomer.close()
    finally:
        guard.close()
        router.close(linger=0)
        ctx.term()
