"""A router built from vLLM's format follows a real CacheEngine's holdings exactly.

CacheEngine in-process with a real EventBus, a small L1 (evictions) and a small disk L2
(evictions there too); KV events go through a real ZMQ PUB socket to ``router.Consumer``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.keys import fold64
from kvcache.kv_events.messages import EventBatch
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher
from kvcache.layouts import KVFormat
from kvcache.observability.bus import EventBus
from kvcache.testing import make_kv_caches
from tests.kv_events.router import Consumer, wait_connected

BS, CS, NB = 16, 32, 64
CHUNK_BYTES = 2 * 2 * CS * 2 * 64 * 2  # KV x layers x tokens x (heads*head) x bf16


def disk_keys(path: Path) -> set[int]:
    return {int(p.name.split(".")[0], 16) for p in path.rglob("*.kvc")}


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_router_matches_engine_after_mixed_workload(tmp_path: Path, fmt: str) -> None:
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    sub = KVEventsSubscriber(pub, chunk_size=CS, fmt=fmt, registry=reg)  # type: ignore[arg-type]
    bus.register_subscriber(sub)
    bus.start()
    cfg = EngineConfig(
        chunk_size=CS,
        l1_size_bytes=10 * CHUNK_BYTES,
        l1_extent_bytes=2 * CHUNK_BYTES,
        l1_pin_memory=False,
        l2_disk_path=str(tmp_path / "l2"),
        l2_disk_size_bytes=24 * (CHUNK_BYTES + 256),
        l2_workers=2,
    )
    engine = CacheEngine(cfg, bus=bus)
    router = Consumer(pub.endpoint, pub.replay_endpoint, fmt=fmt, topic="kv")
    try:
        wait_connected(lambda: pub.publish(EventBatch(0.0, [])), router)
        kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=NB, block_size=BS)
        engine.register(0, "m", kv)
        rng = random.Random(7)
        system = [rng.randrange(50_000) for _ in range(2 * CS)]
        convs = [
            system + [rng.randrange(50_000) for _ in range(rng.randrange(CS, 5 * CS))] for _ in range(12)
        ]
        blocks = list(range(NB))
        for step in range(80):
            conv = rng.randrange(len(convs))
            if rng.random() < 0.5:  # the conversation grows by one turn
                convs[conv] = (convs[conv] + [rng.randrange(50_000) for _ in range(CS)])[: NB * BS]
            tokens = convs[conv]
            op = rng.random()
            if op < 0.5:
                engine.store(0, tokens, blocks)
            elif op < 0.8:
                engine.retrieve(0, tokens, blocks)
            else:
                engine.lookup(0, tokens)
            if step % 20 == 19:
                engine.flush(10)
        assert engine.flush(10)
        assert bus.flush(10)
        pub.publish(EventBatch(-1.0, []))  # end-of-test marker
        deadline = time.monotonic() + 10
        while not (router.batches and router.batches[-1][1].ts == -1.0):
            assert time.monotonic() < deadline
            router.poll(50)

        l1 = engine.status()["l1"]
        on_disk = disk_keys(tmp_path / "l2")
        ours_cpu = sub.held_keys("CPU")
        # Exact L1 contents: every key announced is resident, and nothing else is.
        assert len(ours_cpu) == l1["num_chunks"]
        assert all(k in engine._pool for k in ours_cpu)  # NOTE: no public per-key L1 readback yet
        assert router.held.get("CPU", set()) == {fold64(k) for k in ours_cpu}
        assert router.held.get("STORAGE", set()) == {fold64(k) for k in on_disk}
        # The workload really exercised evictions in both tiers.
        kinds = [type(e).__name__.removeprefix("Old") for _, b in router.batches for e in b.events]
        media = {e.medium for _, b in router.batches for e in b.events if hasattr(e, "medium")}
        assert kinds.count("BlockRemoved") >= 2 and media == {"CPU", "STORAGE"}
        assert l1["num_chunks"] > 0 and on_disk
        assert all(router.block_sizes[h] == CS for h in router.held["CPU"])
    finally:
        engine.close()
        bus.stop()
        router.close()
    assert pub.dropped_batches == 0
