"""``UnfinishedMessages`` on a real loopback TCP connection: the kernel's byte count, and the
rule that cuts a connection receiving more than a message without delivering one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvcache.server.unfinished import UnfinishedMessages, bytes_received

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
