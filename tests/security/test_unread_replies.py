"""A reply the daemon cannot deliver is dropped, counted by reason, and the daemon serves on.

ZMQ's ROUTER drops a message it cannot route without a word: to a client that left, or to one
that leaves more replies unread than the socket's high-water mark (about 1,000 per connection,
plus what the kernel's socket buffers hold). The daemon holds no more for such a client (a
client that never reads must not grow its memory), but a silent drop hid both from the
operator: the client's calls timed out and nothing on the daemon's side said why. Each reply
the socket refuses is now counted in ``kvcache_replies_dropped_total{reason}`` (``unread``: the
client's queue was full, including a client that left with a full queue; ``gone``: the socket
had no connection for the client, which had left with room in its queue), against a real
daemon. Replies ZMQ had already accepted for a connection that then closes are lost uncounted,
so the count is a lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import encode_request, pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from tests.server.helpers import scrape

# Far past the replies a connection's queue holds: about 1,000 (the high-water mark) plus what
# the kernel's socket buffers hold.
PINGS = 50_000


def _dropped(d: DaemonProcess, reason: str, deadline_s: float = 60.0) -> float:
    """``kvcache_replies_dropped_total{reason}`` once it is above 0 (0 if it never is)."""
    deadline = time.monotonic() + deadline_s
    while True:
        for line in scrape(d.metrics_url).splitlines():
            if line.startswith(f'kvcache_replies_dropped_total{{reason="{reason}"}}'):
                value = float(line.rsplit(" ", 1)[1])
                if value > 0:
                    return value
        if time.monotonic() > deadline:
            return 0.0
        time.sleep(0.2)  # the count is published by the daemon's loop: a scrape is the only window


def test_replies_left_unread_past_the_queue_are_dropped_counted_and_others_are_served(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    assert d.ipc_endpoint is not None
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(d.ipc_endpoint)
    try:
        for i in range(PINGS):  # and never read
            sock.send(encode_request(i, m.Ping()))
        assert _dropped(d, "unread") > 0, "no undeliverable reply was counted"
        with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=10) as other:
            assert other.ping() is False  # answered: the daemon is up and serves everyone else
    finally:
        sock.close()


def test_a_reply_to_a_client_that_left_is_counted_as_gone(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    assert d.ipc_endpoint is not None
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                  block_size=4, head_size=8, dtype=torch.float16))  # fmt: skip
    with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=10) as client:
        client.register_kv_caches(kv)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.ipc_endpoint)
        # An await for a chunk nobody stores, answered at its bound: by then its sender is gone.
        # The test lasts that bound (the reply is only refused once it is sent), and the close
        # must reach the daemon within it (a local socket: milliseconds), so 5 s leaves a wide
        # margin on a loaded machine without making the test slow.
        body = m.Retrieve(instance_id=1, token_ids=pack_ids(list(range(10**6, 10**6 + 16))),
                          block_ids=pack_ids([0, 1, 2, 3]), token=client.session.token,
                          await_chunks=1, await_ms=5_000)  # fmt: skip
        sock.send(encode_request(1, body))
        deadline = time.monotonic() + 5
        while client.status()["in_flight"] < 1:  # until the daemon has read it
            assert time.monotonic() < deadline, "the await was never read"
            time.sleep(0.01)  # a status call per turn, not a spin on a shared core
        sock.close()
        assert _dropped(d, "gone") == 1
        assert client.ping() is True
