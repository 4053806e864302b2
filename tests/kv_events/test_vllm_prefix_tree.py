"""A router built on vLLM's own event classes rebuilds kvcache's holdings as a prefix tree.

A scripted run of a real CacheEngine (small L1 and disk tiers that evict, a real Redis tier)
with continuation stores, engine block hashes, Redis TTL expiry and a daemon restart on the
same disk directory. Each incarnation's KV events travel through a real ZMQ PUB socket; the
payloads are decoded by ``vllm_tree.py`` under the vLLM venv (vLLM's ``msgspec`` classes),
which rebuilds a tree per medium: block hash -> (parent hash, token ids). That tree must equal
the truth: every block of every chunk that L1 (``CPU``) or disk + Redis (``STORAGE``) really
holds, under the parent and with the tokens of its place in its prompt. Both wire forms.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import msgspec
import pytest
import redis
from prometheus_client import CollectorRegistry

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.engine.instance import InstanceState
from kvcache.keys import fold64
from kvcache.kv_events.messages import EventBatch
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher
from kvcache.layouts import KVFormat
from kvcache.observability.bus import Callback, EventBus, EventSubscriber
from kvcache.observability.event import Event, EventType
from kvcache.testing import make_kv_caches
from kvcache.testing.redis_local import LocalRedis
from tests.kv_events.router import Consumer, wait_connected

BS, CS, NB = 16, 32, 64
BPC = CS // BS
CHUNK_BYTES = 2 * 2 * CS * 2 * 64 * 2  # KV x layers x tokens x (heads*head) x bf16
PREFIX = "tree:"
TTL_MS = 50
"""How far ahead the test expires a key. 1 ms was too close: an EXPIRE whose time has already
passed when Redis checks it (a loaded machine) deletes the key with a ``del`` event, never
``expired``, so the tier rightly reports nothing (CI lost 1 of 18 that way, twice)."""
pytestmark = pytest.mark.slow  # one vLLM import (~7 s) for the module

Tree = dict[str, dict[int, tuple[int | None, tuple[int, ...]]]]


@pytest.fixture()
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _expire_now(raw: redis.Redis, keys: Iterable[int]) -> None:
    """Touch each key until Redis finds it expired: a lazy expiry publishes its ``expired``
    event at once, where the active cycle (sampling ten times a second) may outlast the wait
    bound on a loaded machine."""
    for k in keys:
        while raw.exists(f"{PREFIX}{k:032x}"):
            pass


class RedisExpiries(EventSubscriber):
    """Lets the test wait until the Redis tier reported keys the server expired."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._cond = threading.Condition()

    @property
    def name(self) -> str:
        return "RedisExpiries"

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.L2_KEYS_EVICTED: self._on_evicted}

    def _on_evicted(self, event: Event) -> None:
        if event.metadata.backend == "redis":
            with self._cond:
                self.seen.update(event.metadata.keys)
                self._cond.notify_all()

    def wait(self, keys: set[int], timeout: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: keys <= self.seen, timeout)

    def missing(self, keys: set[int]) -> set[int]:
        with self._cond:
            return keys - self.seen


class Recorder(Consumer):
    """The reference router's consumer, keeping every payload it applied, in seq order."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.payloads: list[bytes] = []

    def apply(self, seq: int, payload: bytes) -> None:
        super().apply(seq, payload)
        self.payloads.append(payload)


class Incarnation:
    """One daemon lifetime: engine, bus, KV-events subscriber, ZMQ publisher, recorder."""

    def __init__(self, tmp: Path, redis_url: str, fmt: str) -> None:
        self.reg = CollectorRegistry()
        self.bus = EventBus(registry=self.reg)
        self.pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
        self.sub = KVEventsSubscriber(self.pub, chunk_size=CS, fmt=fmt, registry=self.reg)  # type: ignore[arg-type]
        self.expiries = RedisExpiries()
        self.bus.register_subscriber(self.sub)
        self.bus.register_subscriber(self.expiries)
        self.router = Recorder(self.pub.endpoint, self.pub.replay_endpoint, fmt=fmt, topic="kv")
        wait_connected(lambda: self.pub.publish(EventBatch(0.0, [])), self.router)
        self.bus.start()  # after the router joined: a restarted disk tier announces at once
        cfg = EngineConfig(
            chunk_size=CS,
            l1_size_bytes=8 * CHUNK_BYTES,
            l1_extent_bytes=2 * CHUNK_BYTES,
            l1_pin_memory=False,
            l2_disk_path=str(tmp / "disk"),
            l2_disk_size_bytes=10 * (CHUNK_BYTES + 1024),
            l2_redis_url=redis_url,
            l2_redis_key_prefix=PREFIX,
            l2_workers=1,
        )
        self.engine = CacheEngine(cfg, bus=self.bus)
        kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=NB, block_size=BS)
        self.inst = InstanceState(0, "m", self.engine.register(0, "m", kv))
        self.marks = 0

    def settle(self) -> list[bytes]:
        """Everything done so far, delivered to the router; its payloads."""
        assert self.engine.flush(10) and self.bus.flush(10)
        self.marks += 1
        self.pub.publish(EventBatch(-float(self.marks), []))  # end marker, one of its own
        deadline = time.monotonic() + 10
        while not (self.router.batches and self.router.batches[-1][1].ts == -float(self.marks)):
            assert time.monotonic() < deadline, "end marker never arrived"
            self.router.poll(50)
        return list(self.router.payloads)

    def close(self) -> None:
        self.engine.close()
        self.bus.stop()
        self.router.close()


class Script:
    """The prompts of the run and what each chunk must be announced as."""

    def __init__(self) -> None:
        rng = random.Random(13)
        self.tokens = {
            name: [rng.randrange(200_000) for _ in range(7 * CS)] for name in ("e", "c1", "c2", "c3")
        }
        self.hashes = [rng.randrange(1, 2**63) for _ in range(7 * BPC)]  # the engine's, for "e"
        self.expected: dict[int, list[tuple[int, int | None, tuple[int, ...]]]] = {}

    def learn(self, inst: InstanceState) -> None:
        """Per chunk key of every prompt: its blocks as (hash, parent, tokens)."""
        for name, toks in self.tokens.items():
            keys = inst.keys(toks)
            for i, k in enumerate(keys):
                chunk = toks[i * CS : (i + 1) * CS]
                if name == "e":
                    hs = self.hashes[i * BPC : (i + 1) * BPC]
                    parent = self.hashes[i * BPC - 1] if i else None
                else:
                    hs = [fold64(k)]
                    parent = fold64(keys[i - 1]) if i else None
                blocks = []
                for j, h in enumerate(hs):
                    blocks.append((h, parent, tuple(chunk[j * (CS // len(hs)) : (j + 1) * (CS // len(hs))])))
                    parent = h
                self.expected[k] = blocks

    def store(self, inc: Incarnation, name: str, chunks: int) -> None:
        toks = self.tokens[name][: chunks * CS]
        hashes = self.hashes[: chunks * BPC] if name == "e" else None
        inc.engine.store(0, toks, list(range(NB)), block_hashes=hashes)

    def truth(self, inc: Incarnation, disk: Path, raw: redis.Redis) -> Tree:
        on_disk = {int(p.name.split(".")[0], 16) for p in disk.rglob("*.kvc")}
        in_redis = {int(n.decode()[len(PREFIX) :], 16) for n in raw.scan_iter(match=f"{PREFIX}*")}
        # NOTE: no public per-key L1 readback yet (as in test_router_follows_engine).
        in_l1 = {k for k in self.expected if k in inc.engine._pool}
        tree: Tree = {}
        for medium, keys in (("CPU", in_l1), ("STORAGE", on_disk | in_redis)):
            if keys:
                tree[medium] = {h: (p, t) for k in keys for h, p, t in self.expected[k]}
        return tree


class TreeRebuilder:
    """One ``vllm_tree.py`` process under the vLLM venv, asked once per rebuild (vLLM is
    imported once for the whole module instead of once per rebuild)."""

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).with_name("vllm_tree.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def __call__(self, payloads: list[bytes], fmt: str, tmp: Path) -> Tree:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        path = tmp / f"payloads-{fmt}.msgpack"
        path.write_bytes(msgspec.msgpack.encode(payloads))
        self.proc.stdin.write(f"{fmt} {path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            pytest.fail(f"vllm_tree.py exited: {self.proc.stderr.read()[-4000:]}")
        raw = json.loads(line)
        return {m: {int(h): (p, tuple(t)) for h, (p, t) in held.items()} for m, held in raw.items() if held}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def rebuilt(vllm_python: str) -> Iterator[TreeRebuilder]:
    r = TreeRebuilder(vllm_python)
    yield r
    r.close()


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_vllm_router_tree_equals_true_holdings(
    tmp_path: Path,
    redis_server: LocalRedis,
    rebuilt: TreeRebuilder,
    fmt: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvcache.storage.l2.redis.notify")

    def expired(keys: set[int]) -> str:  # why a wait failed: what never arrived, and the feed's log
        return (
            f"{len(a.expiries.missing(keys))} of {len(keys)} expiries never reported "
            f"(events dropped by the bus: {a.bus.dropped_events}); {caplog.text}"
        )

    raw = redis.Redis.from_url(redis_server.url)
    script = Script()
    a = Incarnation(tmp_path, redis_server.url, fmt)
    try:
        script.learn(a.inst)
        script.store(a, "e", 2)  # engine block hashes ...
        script.store(a, "e", 4)  # ... and their continuation
        script.store(a, "c1", 1)  # chunk-keyed ...
        script.store(a, "c1", 5)  # ... continued: hangs under c1's chunk 0
        script.store(a, "c2", 3)
        script.store(a, "c3", 5)  # L1 and disk evict by now
        script.store(a, "c2", 6)
        c1 = a.inst.keys(script.tokens["c1"][: 2 * CS])
        assert a.engine.flush(10)  # the Redis writes are asynchronous: let them land first
        for k in c1:  # Redis TTL expiry (c1 left the small disk tier already)
            assert raw.pexpire(f"{PREFIX}{k:032x}", TTL_MS), "c1 never reached Redis"
        _expire_now(raw, c1)
        assert a.expiries.wait(set(c1)), expired(set(c1))
        payloads = a.settle()
        truth = script.truth(a, tmp_path / "disk", raw)
        assert not {fold64(k) for k in c1} & set(truth["STORAGE"])  # really gone everywhere
        assert rebuilt(payloads, fmt, tmp_path) == truth
        # Before the restart, let every Redis chunk expire: a restarted daemon announces its
        # disk tier, not what a shared Redis holds (it never lists a shared server's keys).
        left = {int(n.decode()[len(PREFIX) :], 16) for n in raw.scan_iter(match=f"{PREFIX}*")}
        for k in left:
            assert raw.pexpire(f"{PREFIX}{k:032x}", TTL_MS)
        _expire_now(raw, left)
        assert a.expiries.wait(left), expired(left)
        payloads = a.settle()
        assert rebuilt(payloads, fmt, tmp_path) == script.truth(a, tmp_path / "disk", raw)
    finally:
        a.close()

    b = Incarnation(tmp_path, redis_server.url, fmt)  # the daemon restarted on the same disk
    try:
        # What the restarted disk tier announced before any request, as the first run did.
        assert rebuilt(b.settle(), fmt, tmp_path) == script.truth(b, tmp_path / "disk", raw)
        hit = b.engine.lookup(0, script.tokens["c3"][: 5 * CS])  # prefetch from disk into L1
        assert hit > 0
        b.engine.retrieve(0, script.tokens["c3"][:hit], list(range(NB)))
        script.store(b, "c3", 6)  # continues a prompt stored before the restart
        script.store(b, "e", 6)
        payloads = b.settle()
        assert rebuilt(payloads, fmt, tmp_path) == script.truth(b, tmp_path / "disk", raw)
    finally:
        b.close()
