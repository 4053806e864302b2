"""The KV-events replay socket from a hostile reader, against a real daemon process.

A reader's replay requests are its bytes: an oversized frame, or requests without pause
whose answers it never reads, must leave the live stream flowing, other readers' replays
answered and every engine served.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import zmq

from kvcache.kv_events.messages import seq_bytes
from kvcache.server.launch import DaemonProcess

from .test_doors import BLOCKS, TOKENS, _replay_tokens, _store_something


def test_a_reader_flooding_the_replay_socket_leaves_the_stream_and_the_engines_served(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--kv-events")
    live_path = os.path.join(d.runtime_dir, "kv-events.sock")
    replay = f"ipc://{os.path.join(d.runtime_dir, 'kv-events-replay.sock')}"
    owner, _ = _store_something(d)
    ctx = zmq.Context()
    live = ctx.socket(zmq.SUB)
    live.setsockopt(zmq.SUBSCRIBE, b"")
    live.connect(f"ipc://{live_path}")
    big = ctx.socket(zmq.DEALER)
    flood = ctx.socket(zmq.DEALER)
    try:
        with owner:
            assert _replay_tokens(replay) == TOKENS  # a batch is buffered: each request replays it
            big.connect(replay)
            big.send(b"x" * 1_000_000)  # past the replay socket's frame bound: dropped
            flood.connect(replay)
            for _ in range(2000):  # never reads a reply
                flood.send(seq_bytes(0))
            tail = [t + 1000 for t in TOKENS]
            seen: list[int] = []
            while tail[0] not in seen:  # the live stream still carries new stores
                owner.store(tail, BLOCKS)
                if live.poll(2000):
                    for ev in msgspec.msgpack.decode(live.recv_multipart()[2])[1]:
                        if ev.get("type") == "BlockStored":
                            seen += ev["token_ids"]
            assert owner.lookup(tail) == 64  # the engine is served
            assert TOKENS[0] in _replay_tokens(replay)  # another reader's replay is answered
        assert "got 1000000" not in d.log  # the oversized frame never reached the publisher
        assert d.proc.poll() is None
    finally:
        for s in (live, big, flood):
            s.close(0)
        ctx.term()
