"""A KV-events consumer written only from vLLM's documented wire format: plain pyzmq + msgspec.

Deliberately imports nothing from ``kvcache``: if this decodes our stream and follows our
holdings, so can any router built from vLLM's ``kv_events.py``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END = -1


# -- vLLM >= 0.24 (map form) -------------------------------------------------------------------
class MapEvent(msgspec.Struct, tag=True):
    pass


class BlockStored(MapEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(MapEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(MapEvent):
    pass


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- vLLM <= 0.23 (array form) -----------------------------------------------------------------
class ArrayEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class OldBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


class GapError(Exception):
    """A gap that replay could not fill (the batches left the replay buffer or were dropped)."""


class Consumer:
    """SUB for the live stream, DEALER for replay; applies batches in seq order to ``held``."""

    def __init__(self, endpoint: str, replay: str | None, fmt: str = "map", topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.IPV6, int("://[" in endpoint))  # tcp://[::1]:N needs it
        self.sub.connect(endpoint)
        self.dealer = None
        if replay is not None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.RCVHWM, 0)  # a whole replay, however long: never cut
            self.dealer.setsockopt(zmq.IPV6, int("://[" in replay))
            self.dealer.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(MapBatch if fmt == "map" else ArrayBatch)
        self.next_seq = 0
        self.batches: list[tuple[int, Any]] = []
        self.held: dict[str, set[int]] = {}
        self.block_sizes: dict[int, int] = {}
        self.gaps_recovered = 0
        self.topics: set[bytes] = set()

    def close(self) -> None:
        self.sub.close(0)
        if self.dealer is not None:
            self.dealer.close(0)
        self.ctx.term()

    # -- applying --------------------------------------------------------------------------
    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, (seq, self.next_seq)
        batch = self.decoder.decode(payload)
        self.batches.append((seq, batch))
        for ev in batch.events:
            kind = type(ev).__name__.removeprefix("Old")
            if kind == "AllBlocksCleared":
                self.held.clear()
            elif kind == "BlockStored":
                self.held.setdefault(ev.medium, set()).update(ev.block_hashes)
                for h in ev.block_hashes:
                    self.block_sizes[h] = ev.block_size
            else:
                self.held.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
        self.next_seq = seq + 1

    def replay_from(self, start: int, timeout: float = 5.0) -> list[int]:
        """Ask for every buffered batch from ``start``; returns the seqs received."""
        assert self.dealer is not None
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.dealer.poll(100):
                continue
            frames = self.dealer.recv_multipart()  # [b"", topic, seq, payload] (vLLM's shape)
            assert frames[0] == b""
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END:
                assert frames[1] == frames[3] == b""
                return got
            assert frames[1] in self.topics or not self.topics, frames[1]
            got.append(seq)
            if seq == self.next_seq:
                self.apply(seq, frames[3])
        raise TimeoutError("no replay end marker")

    def poll(self, timeout_ms: int = 100) -> bool:
        """Receive one live message (recovering any gap first); False on timeout."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_b, payload = self.sub.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_b, "big")
        if seq < self.next_seq:
            return True  # already applied through replay
        if seq > self.next_seq:
            if self.dealer is None:
                raise GapError(f"gap {self.next_seq}..{seq - 1} and no replay socket")
            self.replay_from(self.next_seq)
            if self.next_seq < seq:
                raise GapError(f"replay could not fill {self.next_seq}..{seq - 1}")
            self.gaps_recovered += 1
            if seq < self.next_seq:
                return True
        self.apply(seq, payload)
        return True

    def follow_until(self, last_seq: int, timeout: float = 5.0) -> None:
        """Consume until batch ``last_seq`` was applied."""
        deadline = time.monotonic() + timeout
        while self.next_seq <= last_seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"stuck at seq {self.next_seq}, waiting for {last_seq}")
            self.poll(50)


def wait_connected(pub_probe: Any, consumer: Consumer, timeout: float = 5.0) -> int:
    """PUB/SUB joins asynchronously: publish empty probe batches (``pub_probe()``) until one
    arrives, and start following the stream from there (as a router joining at startup).
    Returns the probe's seq."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub_probe()
        if consumer.sub.poll(20):
            _, seq_b, payload = consumer.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            assert not consumer.decoder.decode(payload).events
            consumer.next_seq = seq + 1
            return seq
    raise TimeoutError("SUB never connected")
