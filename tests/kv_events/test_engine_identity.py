"""What a real CacheEngine's stores look like on the KV-event wire: parents, tokens, identity.

In-process engine, real EventBus, the in-memory publisher of ``test_subscriber``: each test
reads the BlockStored / BlockRemoved a router would get and checks them against the prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.engine.instance import InstanceState
from kvcache.keys import fold64
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.layouts import KVFormat
from kvcache.observability.bus import EventBus
from kvcache.testing import make_kv_caches
from tests.kv_events.test_subscriber import ListPublisher

BS, CS, NB = 16, 32, 64
CHUNK_BYTES = 2 * 2 * CS * 2 * 64 * 2  # KV x layers x tokens x (heads*head) x bf16


class Rig:
    """An engine, its bus and a KV-events subscriber publishing into a list."""

    def __init__(self, tmp_path: Path | None = None, **sub_options: object) -> None:
        self.reg = CollectorRegistry()
        self.bus = EventBus(registry=self.reg)
        self.pub = ListPublisher()
        self.sub = KVEventsSubscriber(self.pub, chunk_size=CS, registry=self.reg, **sub_options)  # type: ignore[arg-type]
        self.bus.register_subscriber(self.sub)
        self.bus.start()
        disk = {} if tmp_path is None else {"l2_disk_path": str(tmp_path), "l2_disk_size_bytes": 1 << 24}
        cfg = EngineConfig(chunk_size=CS, l1_size_bytes=16 * CHUNK_BYTES, l1_pin_memory=False, **disk)  # type: ignore[arg-type]
        self.engine = CacheEngine(cfg, bus=self.bus)
        kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=NB, block_size=BS)
        self.ctx = self.engine.register(0, "m", kv)

    def keys(self, tokens: list[int]) -> list[int]:
        """The chunk keys the engine files ``tokens`` under (its key scoping, recomputed)."""
        return InstanceState(0, "m", self.ctx).keys(tokens)

    def settle(self) -> list[tuple[str, ...]]:
        assert self.engine.flush(10)
        assert self.bus.flush(10)
        return self.pub.events()

    def close(self) -> None:
        self.engine.close()
        self.bus.stop()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def prompt(n_chunks: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CS)]


def test_a_continuation_store_hangs_under_the_previous_chunk(rig: Rig) -> None:
    tokens = prompt(4)
    k = rig.keys(tokens)
    rig.engine.store(0, tokens[: 2 * CS], list(range(NB)))
    rig.engine.store(0, tokens, list(range(NB)))  # chunks 0-1 present: 2-3 continue them
    stored = [e for e in rig.settle() if e[0] == "BlockStored"]
    assert [(e[2], e[4]) for e in stored] == [
        ((fold64(k[0]), fold64(k[1])), None),
        ((fold64(k[2]), fold64(k[3])), fold64(k[1])),
    ]


def test_chunk_keyed_blocks_carry_their_tokens_in_every_tier(tmp_path: Path) -> None:
    """vLLM's BlockStored carries block_size x len(block_hashes) token ids; so do ours, in
    both media (routers that hash tokens themselves need them)."""
    rig = Rig(tmp_path)
    try:
        tokens = prompt(3)
        rig.engine.store(0, tokens[:CS], list(range(NB)))
        rig.engine.store(0, tokens, list(range(NB)))
        stored = [e for e in rig.settle() if e[0] == "BlockStored"]
        for _, medium, hashes, block_size, _, toks in stored:
            assert len(toks) == block_size * len(hashes), medium
        cpu = [e for e in stored if e[1] == "CPU"]
        assert [e[5] for e in cpu] == [tuple(tokens[:CS]), tuple(tokens[CS:])]
        by_hash = {e[2][0]: e[5] for e in stored if e[1] == "STORAGE"}
        k = rig.keys(tokens)
        assert by_hash == {fold64(k[i]): tuple(tokens[i * CS : (i + 1) * CS]) for i in range(3)}
    finally:
        rig.close()


def test_token_ids_can_be_left_off_the_wire() -> None:
    rig = Rig(token_ids=False)
    try:
        rig.engine.store(0, prompt(2), list(range(NB)), block_hashes=list(range(100, 104)))
        rig.engine.store(0, prompt(2, seed=2), list(range(NB)))
        stored = [e for e in rig.settle() if e[0] == "BlockStored"]
        assert len(stored) == 2 and all(e[5] == () for e in stored)
    finally:
        rig.close()


def tree_edges(
    events: list[tuple[str, ...]], medium: str
) -> dict[int, tuple[int | None, int, tuple[int, ...]]]:
    """What a router files per block from the BlockStored of ``medium``: block hash ->
    (parent hash, block size, the block's tokens), however the blocks were grouped in events."""
    out: dict[int, tuple[int | None, int, tuple[int, ...]]] = {}
    for kind, med, hashes, block_size, parent, toks in events:
        if kind != "BlockStored" or med != medium:
            continue
        for i, h in enumerate(hashes):
            block_tokens = tuple(toks[i * block_size : (i + 1) * block_size])  # type: ignore[index, operator]
            out[h] = (parent if i == 0 else hashes[i - 1], block_size, block_tokens)  # type: ignore[assignment]
    return out


def test_a_restarted_daemon_reannounces_disk_chunks_exactly_as_before(tmp_path: Path) -> None:
    """Engine block hashes, tokens and continuation parents survive a restart in the disk
    chunk files' headers: the restarted tier's BlockStored(STORAGE) file every block where
    the first run filed it."""
    base = prompt(3)
    rig = Rig(tmp_path)
    try:
        rig.engine.store(0, base[: 2 * CS], list(range(NB)), block_hashes=list(range(500, 504)))
        rig.engine.store(0, base, list(range(NB)))  # chunk 2 continues them, without hashes
        other = prompt(2, seed=3)
        rig.engine.store(0, other[:CS], list(range(NB)))
        rig.engine.store(0, other, list(range(NB)))  # chunk-keyed continuation
        before = tree_edges(rig.settle(), "STORAGE")
    finally:
        rig.close()
    assert len(before) == 4 + 1 + 2 and before[500] == (None, BS, tuple(base[:BS]))

    again = Rig(tmp_path)
    try:
        after = tree_edges(again.settle(), "STORAGE")
    finally:
        again.close()
    assert after == before


def test_an_engine_hash_beyond_64_bits_never_fails_the_store(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    try:
        res = rig.engine.store(0, prompt(1), list(range(NB)), block_hashes=[2**70, 1])
        rig.settle()
        assert res.stored_chunks == 1 and len(list(tmp_path.rglob("*.kvc"))) == 1
    finally:
        rig.close()
