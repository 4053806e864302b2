"""Fixtures for the hostile-client suite: real daemon processes and raw sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request
from kvcache.server.launch import DaemonProcess, Spawn
from tests.helpers import daemon_starter

BASE_ARGS = ["--chunk-size", "16", "--l1-size-gb", "0.2", "--heartbeat-timeout", "5"]


@pytest.fixture
def start_daemon(daemon_spawn: Spawn | None) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory for daemon processes that are killed (and their socket dirs removed) at the end."""
    yield from daemon_starter(BASE_ARGS, daemon_spawn)


def raw_call(endpoint: str, body: m.RequestBody, timeout_ms: int = 5000) -> m.ReplyBody:
    """One request on a fresh DEALER, as a hand-written hostile client would send it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_request(1, body))
        assert sock.poll(timeout_ms), "no reply from the daemon"
        return decode_reply(sock.recv()).body
    finally:
        sock.close()


def as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child that dropped to ``uid`` (and its gid, no groups), as
    another local user's process would run; returns what ``fn`` returned (msgpack-able).

    Forked, not spawned: the child needs no access to this interpreter's files, only to the
    sockets and paths it goes after. An exception in ``fn`` fails the calling test."""
    import os

    import msgspec

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and exit, never return into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                data, code = msgspec.msgpack.encode(fn()), 0
            except BaseException as exc:
                data = repr(exc).encode()
            with os.fdopen(write_end, "wb") as out:
                out.write(data)
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child as uid {uid} failed: {data.decode()}"
    return msgspec.msgpack.decode(data)
