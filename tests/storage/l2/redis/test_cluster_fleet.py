"""Many daemons, one Redis Cluster L2: real daemon processes share prefixes through a real
3 + 3 cluster, announce them for a router, and ride out the SIGKILL of a master."""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvcache import reference
from kvcache.client import KVCacheClient, to_shared
from kvcache.config import EngineConfig
from kvcache.context import CacheContext
from kvcache.engine import CacheEngine
from kvcache.layouts import KVCaches, KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches, random_fill
from kvcache.testing.redis_cluster_local import LocalRedisCluster, wait_until
from tests.helpers import sealed_redis_args
from tests.server.helpers import free_port, scrape

CS, BS = 16, 4  # 16-token chunks of 4 blocks: small, so every prompt touches every shard
CHUNKS = 8
NB = 2 * CHUNKS * CS // BS  # room for a prompt and a second copy of it
FA, FI = KVFormat.NL_X_TWO_NB_BS_NH_HS, KVFormat.NL_X_NB_TWO_BS_NH_HS


@dataclass
class Fleet:
    cluster: LocalRedisCluster
    a: DaemonProcess
    b: DaemonProcess
    sub: zmq.Socket[bytes]
    events: dict[bytes, list[dict[str, Any]]] = field(default_factory=lambda: {b"a": [], b"b": []})

    def drain(self, timeout_ms: int = 0) -> None:
        """Collect the KV events that arrived (map form), per daemon topic."""
        while self.sub.poll(timeout_ms):
            topic, _seq, payload = self.sub.recv_multipart()
            _ts, events, _rank = msgspec.msgpack.decode(payload)
            self.events[topic] += events
            timeout_ms = 0

    def stored(self, topic: bytes, medium: str) -> set[int]:
        self.drain()
        return {h for e in self.events[topic] if e["type"] == "BlockStored" and e["medium"] == medium
                for h in e["block_hashes"]}  # fmt: skip

    def announced(self, topic: bytes, medium: str) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """Every block a daemon announced in ``medium``: (hash, parent hash, tokens), in order."""
        self.drain()
        out = []
        for e in self.events[topic]:
            if e["type"] == "BlockStored" and e["medium"] == medium:
                hashes, bs, toks = e["block_hashes"], e["block_size"], e["token_ids"]
                for i, h in enumerate(hashes):
                    parent = e["parent_block_hash"] if i == 0 else hashes[i - 1]
                    out.append((h, parent, tuple(toks[i * bs : (i + 1) * bs])))
        return out


@pytest.fixture(scope="module")
def fleet(shared_cluster: LocalRedisCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two daemons (as on two machines) on one cluster; a router-side SUB socket that both
    publish their KV events to, each under its own topic."""
    port = free_port()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    args = ["--chunk-size", str(CS), "--l1-size-gb", "0.2", "--l2-redis-url", shared_cluster.url,
            *sealed_redis_args(tmp_path_factory.mktemp("fleet")),
            "--l2-retry-interval", "0.3", "--l2-redis-timeout", "2", "--l2-redis-connect-timeout", "0.5",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
            "--kv-events-batch-window-ms", "0"]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # start both at once: each takes seconds to import
        fa, fb = (pool.submit(DaemonProcess, [*args, "--kv-events-topic", t]) for t in ("a", "b"))
        a, b = fa.result(), fb.result()
    fleet = Fleet(shared_cluster, a, b, sub)
    try:
        for topic, daemon in ((b"a", a), (b"b", b)):
            _until_subscribed(fleet, topic, daemon)
        yield fleet
    finally:
        for d in (a, b):
            d.kill()
            d.remove_runtime_dir()
        sub.close()


def _until_subscribed(fleet: Fleet, topic: bytes, daemon: DaemonProcess) -> None:
    """Store small fresh prompts until the daemon's PUB has our subscription (ZMQ drops what
    it publishes before that)."""
    kv = to_shared(make_kv_caches(FA, num_layers=1, num_blocks=4, block_size=BS, head_size=8))
    with KVCacheClient(daemon.endpoint, 99, "warm-up", timeout_s=5) as c:
        c.register_kv_caches(kv)
        deadline = time.monotonic() + 15
        for attempt in range(10_000):
            c.store([attempt * 100 + t for t in range(CS)], list(range(4)))
            fleet.drain(50)
            if fleet.events[topic]:
                return
            assert time.monotonic() < deadline, f"no KV event from daemon {topic!r}"


def caches(fmt: KVFormat, seed: int) -> KVCaches:
    return to_shared(make_kv_caches(fmt, num_layers=2, num_blocks=NB, block_size=BS, head_size=8, seed=seed))


def blocks(kv: KVCaches, fmt: KVFormat, ids: range) -> torch.Tensor:
    """The bytes of these blocks, in the layout-independent chunk order (for comparisons)."""
    shape = CacheContext(kv, chunk_size=CS, fmt=fmt).shape
    return reference.gather(kv, fmt, shape, list(ids)).view(torch.uint8)


def prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(CHUNKS * CS)]


FIRST = range(CHUNKS * CS // BS)  # the blocks a prompt is stored from
SECOND = range(len(FIRST), 2 * len(FIRST))


def test_a_prompt_stored_through_one_daemon_is_retrieved_byte_exact_through_another(fleet: Fleet) -> None:
    src, dst = caches(FA, 1), caches(FI, 2)  # the two engines even use different layouts
    with KVCacheClient(fleet.a.endpoint, 1, "fleet", timeout_s=5) as a, \
            KVCacheClient(fleet.b.endpoint, 2, "fleet", timeout_s=5) as b:  # fmt: skip
        a.register_kv_caches(src)
        b.register_kv_caches(dst)
        tokens = prompt(1)
        seen = fleet.stored(b"a", "STORAGE") | fleet.stored(b"b", "CPU")  # the warm-up prompts
        assert a.store(tokens, list(FIRST)).stored_tokens == CHUNKS * CS
        wait_until(lambda: b.lookup_tiers(tokens).hit_tokens == CHUNKS * CS, 10, "the prompt in L2")
        assert b.retrieve(tokens, list(FIRST)) == CHUNKS * CS
        assert torch.equal(blocks(dst, FI, FIRST), blocks(src, FA, FIRST))

    # KV events: A announces the chunks in CPU (its L1) and STORAGE (it wrote the shared
    # tier); B, which found them there, announces them in STORAGE (it can load them too) and
    # in CPU once they sit in its L1, each once, as A did (hashes, parents, tokens: the
    # cluster keeps how A announced each chunk with it).
    def ours() -> set[int]:
        return (fleet.stored(b"a", "STORAGE") & fleet.stored(b"b", "CPU")) - seen

    wait_until(lambda: len(ours()) >= CHUNKS, 10, "both daemons' KV events")
    ours = ours()
    assert len(ours) == CHUNKS and ours <= fleet.stored(b"a", "CPU") and ours <= fleet.stored(b"b", "STORAGE")
    as_a = sorted(b for b in fleet.announced(b"a", "STORAGE") if b[0] in ours)
    assert len(as_a) == CHUNKS and all(toks for _, _, toks in as_a)
    assert sum(parent is None for _, parent, _ in as_a) == 1  # one prompt: one root, seven continuations
    assert sorted(b for b in fleet.announced(b"b", "STORAGE") if b[0] in ours) == as_a  # once each
    assert sorted(b for b in fleet.announced(b"b", "CPU") if b[0] in ours) == as_a


@pytest.mark.parametrize(
    ("other", "shared"),
    [
        ({"fmt": FI}, True),  # another layout of the same model: the same chunk bytes
        ({"chunk_size": 2 * CS}, False),
        ({"dtype": torch.float16}, False),
        ({"num_layers": 3}, False),
        ({"fmt": KVFormat.NL_X_NB_BS_HS, "head_size": 32}, False),  # MLA, same bytes per token
        ({"model": "other-model"}, False),
        ({"salt": "tenant-b"}, False),
    ],
)
def test_engines_share_chunks_exactly_when_they_can_exchange_the_bytes(
    shared_cluster: LocalRedisCluster, other: dict[str, Any], shared: bool
) -> None:
    """Chunk keys fold in model, salt and chunk geometry: another chunk size, dtype, head
    split or MLA never reads these chunks (a hit would hand it wrong bytes); a layout change
    of the same model does, byte-exact. Two engines in one process, each with its own L1."""

    def engine(**kw: Any) -> tuple[CacheEngine, KVCaches, KVFormat, str, str]:
        cfg = EngineConfig(chunk_size=kw.get("chunk_size", CS), l1_size_bytes=1 << 24,
                           l1_extent_bytes=1 << 20, l2_redis_url=shared_cluster.url)  # fmt: skip
        fmt = kw.get("fmt", FA)
        kv = make_kv_caches(fmt, num_layers=kw.get("num_layers", 2), num_blocks=NB, block_size=BS,
                            head_size=kw.get("head_size", 8), dtype=kw.get("dtype", torch.bfloat16),
                            seed=len(kw))  # fmt: skip
        e = CacheEngine(cfg)
        e.register(1, kw.get("model", "geo"), kv, fmt=fmt)
        return e, kv, fmt, kw.get("salt", ""), kw.get("model", "geo")

    tokens = [zlib.crc32(repr(other).encode()) + t for t in range(CHUNKS * CS)]
    writer, src, fmt_a, _, _ = engine()
    reader, dst, fmt_b, salt, _ = engine(**other)
    try:
        assert writer.store(1, tokens, list(FIRST)).stored_chunks == CHUNKS and writer.flush(10)
        hit = reader.lookup(1, tokens, cache_salt=salt)
        assert hit == (CHUNKS * CS if shared else 0)
        if shared:
            assert reader.retrieve(1, tokens, list(FIRST)) == CHUNKS * CS
            assert torch.equal(blocks(dst, fmt_b, FIRST), blocks(src, fmt_a, FIRST))
    finally:
        writer.close()
        reader.close()


def _metric(url: str, name: str, **labels: str) -> float:
    for line in scrape(url).splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_master_killed_mid_loop_never_serves_wrong_bytes_and_every_slot_comes_back(fleet: Fleet) -> None:
    cluster = fleet.cluster
    src, dst = caches(FA, 3), caches(FI, 4)
    gen = torch.Generator().manual_seed(5)
    with KVCacheClient(fleet.a.endpoint, 3, "failover", timeout_s=10) as a, \
            KVCacheClient(fleet.b.endpoint, 4, "failover", timeout_s=10) as b:  # fmt: skip
        a.register_kv_caches(src)
        b.register_kv_caches(dst)
        partial_reads = 0

        def round_trip(i: int, settle: bool = False) -> int:
            """Store prompt i through A; A serves it whole from L1; B gets some prefix of it
            from L2, and every byte of that prefix is right. Returns B's tokens. ``settle``:
            first give A's write-through (asynchronous) a moment to reach the cluster."""
            for layer in src:  # FlashAttention: a [2, NB, BS, NH, HS] tensor per layer
                assert isinstance(layer, torch.Tensor)
                random_fill(layer[:, : len(FIRST)], gen)
            tokens = prompt(1000 + i)
            assert a.store(tokens, list(FIRST)).stored_tokens == CHUNKS * CS
            assert a.retrieve(tokens, list(SECOND)) == CHUNKS * CS  # L1 keeps serving
            assert torch.equal(blocks(src, FA, SECOND), blocks(src, FA, FIRST))
            if settle:
                until = time.monotonic() + 5
                while b.lookup_tiers(tokens).hit_tokens < CHUNKS * CS and time.monotonic() < until:
                    time.sleep(0.02)
            got = b.retrieve(tokens, list(FIRST))
            n = got // BS
            assert torch.equal(blocks(dst, FI, range(n)), blocks(src, FA, range(n))), f"round {i}"
            return got

        for i in range(3):
            round_trip(i)
        victim = cluster.masters()[0]
        victim_slot = next(lo for lo, _, m, _ in cluster.slot_map() if m == victim)
        cluster.kill(victim)
        i, deadline = 3, time.monotonic() + 30
        while cluster.owner_of(victim_slot) == victim:  # store and retrieve through the outage
            partial_reads += round_trip(i) < CHUNKS * CS
            i += 1
            assert time.monotonic() < deadline, "no replica took over"
        new_master = cluster.owner_of(victim_slot)
        assert partial_reads > 0  # the outage was seen: some prompt lost chunks on the dead shard

        # Failures were counted, with their reason, on both sides.
        store_failures = _metric(fleet.a.metrics_url, "kvcache_l2_store_failures_total",
                                 backend="redis-cluster", reason="unavailable")  # fmt: skip
        load_failures = _metric(fleet.b.metrics_url, "kvcache_l2_load_failures_total",
                                backend="redis-cluster", reason="unavailable")  # fmt: skip
        assert store_failures > 0 and load_failures > 0

        # After the promotion every slot works again, with no restart: whole prompts written
        # through A are found through B, including chunks in the slots that moved.
        before = {m: cluster.client(m).dbsize() for m in cluster.masters()}
        fresh = itertools.count(i)  # a new prompt each try: a stored one would be skipped
        wait_until(
            lambda: round_trip(next(fresh), settle=True) == CHUNKS * CS, 15, "whole prompts through B again"
        )
        for _ in range(4):
            assert round_trip(next(fresh), settle=True) == CHUNKS * CS
        after = {m: cluster.client(m).dbsize() for m in cluster.masters()}
        assert set(after) == set(before) and victim not in after and new_master in after
        assert all(after[m] > before[m] for m in after), (before, after)
