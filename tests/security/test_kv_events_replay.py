"""The KV-events replay socket from a hostile reader, against a real daemon process.

A reader's replay requests are its bytes: an oversized frame, or requests without pause
whose answers it never reads, must leave the live stream flowing, other readers' replays
answered and every engine served.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec
import zmq

from kvcache.kv_events.messages import END_SEQ, seq_bytes
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


RATE = 200  # --kv-events-replay-rate: replayed batches a second, all readers together
STEPS = 50  # --kv-events-buffer-steps: the most one request replays (and the budget's burst)


def test_a_replay_flood_costs_the_daemon_no_more_than_its_replay_rate(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Each 8-byte request used to be answered at once with up to the whole buffer: 500
    requests cost 500 x the buffer in sends on the publisher thread (about 23 us of Python,
    under the GIL every request handler needs, per batch: with the default 10,000-batch
    buffer, 320 requests kept a core busy for over a minute). Now replays draw on a budget
    of ``--kv-events-replay-rate`` batches a second (burst: one whole buffer), and requests
    beyond it wait in the socket's own bounded queue. Counted where the flooder reads, so the
    bound holds however slow the machine: never more than the burst plus the rate times the
    time it read."""
    d = start_daemon("--kv-events", "--kv-events-batch-window-ms", "0", "--kv-events-buffer-steps",
                     str(STEPS), "--kv-events-replay-rate", str(RATE))  # fmt: skip
    live_path = os.path.join(d.runtime_dir, "kv-events.sock")
    replay = f"ipc://{os.path.join(d.runtime_dir, 'kv-events-replay.sock')}"
    owner, _ = _store_something(d)
    ctx = zmq.Context()
    live = ctx.socket(zmq.SUB)
    live.setsockopt(zmq.SUBSCRIBE, b"")
    live.connect(f"ipc://{live_path}")
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.RCVHWM, 0)  # it reads all it is sent
    try:
        with owner:
            for i in range(STEPS):  # a full buffer: every request may ask for STEPS batches
                owner.store([100_000 * (i + 1) + t for t in range(len(TOKENS))], BLOCKS)
            assert _replay_tokens(replay) != []
            flood.connect(replay)
            start = time.monotonic()
            for _ in range(500):
                flood.send(seq_bytes(0))
            replayed = 0
            while time.monotonic() - start < 2.0:  # read for a while; the bound uses the real time
                if flood.poll(100):
                    _topic, seq, _payload = flood.recv_multipart()
                    replayed += seq != END_SEQ
            elapsed = time.monotonic() - start
            bound = STEPS + 1 + RATE * elapsed
            assert replayed <= bound, f"{replayed} batches replayed in {elapsed:.2f} s, budget {bound:.0f}"
            tail = [t + 7_000_000 for t in TOKENS]
            seen: list[int] = []
            while tail[0] not in seen:  # the live stream still carries new stores
                owner.store(tail, BLOCKS)
                if live.poll(2000):
                    for ev in msgspec.msgpack.decode(live.recv_multipart()[2])[1]:
                        if ev.get("type") == "BlockStored":
                            seen += ev["token_ids"]
            assert owner.lookup(tail) == 64  # the engine is served
            assert tail[0] in _replay_tokens(replay)  # another reader's replay is answered
        assert d.proc.poll() is None
    finally:
        for s in (live, flood):
            s.close(0)
        ctx.term()
