"""The tier tracker over real ZMQ sockets, without vLLM: both publishers connect to it.

vLLM's side is a raw PUB sending the exact map shape vLLM 0.32 puts on the wire (with the
fields it added after 0.24: ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``); kvcache's
side is its own ``ZmqEventPublisher`` in the array form. The end-to-end test does the same
with a real vLLM and daemon (``test_connector.py``); this one runs in a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvcache.kv_events.messages import EventBatch, EventFactory
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher
from tests.integrations.vllm.tier_tracker import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, TierTracker

BS = 4
TOKENS = list(range(100, 112))  # three blocks


def vllm_stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": MEDIUM_GPU,
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}  # fmt: skip


class VllmPub:
    """A PUB socket that connects, as vLLM's does to a plain ``tcp://host:port``."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.connect(endpoint)
        self.seq = 0

    def send(self, events: list[Any], skip: int = 0) -> None:
        self.seq += skip
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.sock.send_multipart([b"vllm", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def wired() -> Iterator[tuple[TierTracker, VllmPub, ZmqEventPublisher]]:
    tracker = TierTracker()
    vllm = VllmPub(tracker.endpoint)
    kvc = ZmqEventPublisher(tracker.endpoint, topic="kvcache")  # no wildcard: connects
    try:
        yield tracker, vllm, kvc
    finally:
        kvc.shutdown()
        vllm.close()
        tracker.close()


def until(cond: Callable[[], bool], tracker: TierTracker, probe: Callable[[], None]) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, tracker.summary()
        probe()
        tracker.drain(quiet_s=0.02)


def test_one_consumer_follows_both_tiers(wired: tuple[TierTracker, VllmPub, ZmqEventPublisher]) -> None:
    tracker, vllm, kvc = wired
    make = EventFactory("array")

    def probe() -> None:  # empty batches until both subscriptions have reached the publishers
        vllm.send([])
        kvc.publish(EventBatch(ts=time.time(), events=[]))

    until(lambda: {"vllm", "kvcache"} <= set(tracker.sources), tracker, probe)

    h = [11, 12, 13]
    vllm.send([vllm_stored(h, None, TOKENS)])
    kvc.publish(EventBatch(time.time(), [make.stored(h[:2], block_size=BS, medium=MEDIUM_CPU,
                                                     token_ids=TOKENS[:8])]))  # fmt: skip
    kvc.publish(EventBatch(time.time(), [make.stored(h[:2], block_size=BS, medium=MEDIUM_STORAGE)]))
    vllm.send([{"type": "AllBlocksCleared"}])  # reset_prefix_cache
    vllm.send([vllm_stored(h[:2], None, TOKENS[:8])])  # loaded back from kvcache
    until(
        lambda: tracker.summary().get("vllm", {}).get("events", {}).get("stored", 0) >= 2,
        tracker,
        lambda: None,
    )
    until(lambda: tracker.summary()["kvcache"]["events"].get("stored", 0) >= 2, tracker, lambda: None)

    assert not tracker.gaps()
    assert tracker.blocks_of("vllm", TOKENS, BS) == h
    assert tracker.blocks_of("kvcache", TOKENS, BS) == h[:2]  # the join, by content
    stored = tracker.find("vllm", "stored", h, MEDIUM_GPU)
    gone = tracker.find("vllm", "removed", h, MEDIUM_GPU, after=stored)
    assert stored is not None and gone is not None and gone.seq == stored.seq + 1
    at_reset = tracker.state_at(gone)
    assert ("vllm", MEDIUM_GPU) not in at_reset
    assert at_reset[("kvcache", MEDIUM_CPU)] == {11, 12}
    assert tracker.find("vllm", "stored", h[:2], MEDIUM_GPU, after=gone) is not None
    assert tracker.tiers_of(11) == {
        ("vllm", MEDIUM_GPU),
        ("kvcache", MEDIUM_CPU),
        ("kvcache", MEDIUM_STORAGE),
    }
    assert tracker.tiers_of(13) == set()  # cleared from the GPU, never offloaded

    kvc.publish(EventBatch(time.time(), [make.removed([11], medium=MEDIUM_CPU)]))
    vllm.send([], skip=2)  # two batches lost
    until(lambda: bool(tracker.gaps()), tracker, lambda: None)
    until(lambda: ("kvcache", MEDIUM_CPU) not in tracker.tiers_of(11), tracker, lambda: None)
    assert tracker.gaps() == {"vllm": [(vllm.seq - 3, vllm.seq - 1)]}
