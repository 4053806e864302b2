"""CacheEngine with L2 tiers: disk restart and corruption, disk bound, Redis sharing and Redis loss."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.observability.event import Event, EventType
from kvcache.records import LookupHit
from kvcache.testing import caches_equal, make_kv_caches
from kvcache.testing.redis_local import LocalRedis
from tests.helpers import RecordingSink as Sink

BS, CS = 16, 32
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
TOKENS = list(range(500, 500 + 8 * BS))  # 4 chunks
IDS = list(range(8))


def engine(sink: Sink | None = None, **kw: Any) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l1_extent_bytes=1 << 16, **kw)
    return CacheEngine(cfg, bus=sink)


def reg(e: CacheEngine, iid: int, seed: int) -> Any:
    caches = make_kv_caches(FMT, num_blocks=8, block_size=BS, seed=seed)
    e.register(iid, "m", caches)
    return caches


def test_disk_write_through_restart_and_prefetch(tmp_path: Path) -> None:
    with engine(l2_disk_path=str(tmp_path)) as a:
        src = reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
        assert a.flush(5)
        assert a.status()["l2"][0]["num_chunks"] == 4
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path)) as b:  # a restarted process: empty L1
        dst = reg(b, 2, seed=2)
        assert b.status()["l1"]["num_chunks"] == 0
        assert b.lookup_tiers(2, TOKENS) == LookupHit(128, 128)  # all of it from L2
        end = sink.of(EventType.MP_LOOKUP_END)[-1].metadata
        assert (end.l1_hit_tokens, end.l2_hit_tokens) == (0, 128)
        assert b.retrieve(2, TOKENS, IDS) == 128
        assert caches_equal(src, dst)
        r_end = sink.of(EventType.MP_RETRIEVE_END)[-1].metadata
        assert (r_end.l1_tokens, r_end.l2_tokens) == (0, 128)
        assert len(sink.of(EventType.L2_LOAD_FINISHED)) == 4
        assert b.lookup_tiers(2, TOKENS) == LookupHit(128, 0)  # now from L1
        assert sink.of(EventType.MP_LOOKUP_END)[-1].metadata.l1_hit_tokens == 128


def test_retrieve_without_lookup_loads_from_l2(tmp_path: Path) -> None:
    with engine(l2_disk_path=str(tmp_path)) as a:
        src = reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
    with engine(l2_disk_path=str(tmp_path)) as b:
        dst = reg(b, 2, seed=2)
        assert b.retrieve(2, TOKENS, IDS) == 128 and caches_equal(src, dst)


def test_corrupt_chunk_ends_the_prefix(tmp_path: Path) -> None:
    with engine(l2_disk_path=str(tmp_path)) as a:
        reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
    files = sorted(tmp_path.rglob("*.kvc"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 4
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path)) as b:
        dst = reg(b, 2, seed=2)
        from kvcache.keys import ChunkHasher  # the third chunk's key, as the engine derives it

        scope = b"chunk:" + b"x".join(str(d).encode() for d in (2, 2, CS, 128)) + b":bfloat16"
        key = ChunkHasher("m", CS, scope=scope).keys(TOKENS)[2]
        victim = next(p for p in files if p.name.startswith(f"{key:032x}"))
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))
        before = [t.clone() for t in dst]
        assert b.lookup(2, TOKENS) == 128  # the index still lists it; the load finds the damage
        assert b.retrieve(2, TOKENS, IDS) == 64
        failed = sink.of(EventType.L2_LOAD_FAILED)
        assert failed and failed[-1].metadata.reason == "corrupt" and failed[-1].metadata.keys == [key]
        assert not victim.exists()
        for layer, old in zip(dst, before, strict=True):  # blocks 4..7 untouched
            assert torch.equal(layer[4:].view(torch.uint8), old[4:].view(torch.uint8))
        assert b.lookup(2, TOKENS) == 64


def test_disk_bound_evicts(tmp_path: Path) -> None:
    probe_dir = tmp_path / "probe"
    with engine(l2_disk_path=str(probe_dir)) as p:
        reg(p, 1, seed=1)
        p.store(1, TOKENS[:64], IDS[:4])
        p.flush(5)
        # Files differ by their header's meta (the first chunk of a prompt has no parent key).
        one = max(f.stat().st_size for f in probe_dir.rglob("*.kvc"))
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path / "d"), l2_disk_size_bytes=2 * one) as e:
        reg(e, 1, seed=1)
        e.store(1, TOKENS, IDS)
        e.flush(5)
        st = e.status()["l2"][0]
        assert st["num_chunks"] == 2 and st["used_bytes"] <= 2 * one
        evicted = sink.of(EventType.L2_KEYS_EVICTED)
        assert sum(len(ev.metadata.keys) for ev in evicted) == 2
        assert e.lookup(1, TOKENS) == 128  # L1 still has everything


def test_redis_shared_between_engines(redis_server: LocalRedis) -> None:
    kw = {"l2_redis_url": redis_server.url, "l2_redis_key_prefix": "share:"}
    with engine(**kw) as a, engine(**kw) as b:  # two "machines"
        src = reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
        assert a.flush(5)
        dst = reg(b, 1, seed=2)
        assert b.lookup(1, TOKENS) == 128
        assert b.retrieve(1, TOKENS, IDS) == 128 and caches_equal(src, dst)


def test_redis_killed_mid_run_engine_keeps_serving(redis_server: LocalRedis) -> None:
    sink = Sink()
    kw = {"l2_redis_url": redis_server.url, "l2_retry_interval_s": 0.05, "l2_redis_socket_timeout_s": 0.5}
    with engine(sink, **kw) as e:
        src = reg(e, 1, seed=1)
        dst = reg(e, 2, seed=2)
        e.store(1, TOKENS[:64], IDS[:4])
        assert e.flush(5)
        redis_server.stop()
        r = e.store(1, TOKENS, IDS)  # L1 takes it; the L2 writes fail or are refused
        assert r.stored_chunks == 2
        assert e.flush(5)
        assert e.lookup(2, TOKENS) == 128 and e.retrieve(2, TOKENS, IDS) == 128
        assert caches_equal(src, dst)
        info = e.status()["l2"][0]
        assert info["store_failures"] + info["stores_dropped"] == 2
        assert sink.of(EventType.L2_STORE_FAILED)
        redis_server.start()
        deadline = time.monotonic() + 5
        attempt = 0
        while True:  # the tier comes back after its retry interval (fresh chunks each try:
            attempt += 1  # a chunk already in L1 is skipped, so it is not written through again)
            e.store(1, [t + 1000 * attempt for t in TOKENS], IDS)
            e.flush(5)
            if e.status()["l2"][0]["stores"] > 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert e.status()["l2"][0]["stores"] > 2


class _HoldingSink(Sink):
    """Holds every disk write inside its ``L2_STORE_FINISHED`` announcement until ``gate`` is
    set: the write-through is then in flight and its L1 slots stay pinned, deterministically."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is EventType.L2_STORE_FINISHED:
            self.gate.wait(10)


def test_second_geometry_gets_memory_while_the_first_is_written_through(tmp_path: Path) -> None:
    """A small L1 (far below two default 64 MiB extents) shared by two layouts: the first one's
    extent must not take the whole pool, or the second gets nothing while the first's chunks
    are pinned by their disk writes (and, once they are not, evicts all of them to get a slot)."""
    sink = _HoldingSink()
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 20, l2_disk_path=str(tmp_path))  # 32 chunks of A
    with CacheEngine(cfg, bus=sink) as e:
        try:
            reg(e, 1, seed=1)  # 32 KiB chunks
            e.register(2, "m", make_kv_caches(FMT, num_layers=3, num_blocks=8, block_size=BS, seed=2))
            assert e.store(1, TOKENS, IDS).stored_chunks == 4  # an eighth of L1, pinned by the disk writes
            r = e.store(2, TOKENS, IDS)  # another geometry (48 KiB chunks), while those writes are held
            assert (r.stored_chunks, r.failed_chunks) == (4, 0)
        finally:
            sink.gate.set()  # before close(), which waits for the held writes
        assert e.flush(5)
        assert not sink.of(EventType.L1_KEYS_EVICTED)
        assert e.lookup(1, TOKENS) == 128 and e.lookup(2, TOKENS) == 128
        assert sink.of(EventType.MP_LOOKUP_END)[-1].metadata.l1_hit_tokens == 128


class _HoldingLoads(Sink):
    """Holds every L2 load inside its ``L2_LOAD_FINISHED`` announcement until ``gate`` is
    set: the load is in flight and its L1 slot stays pinned, deterministically."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is EventType.L2_LOAD_FINISHED:
            self.gate.wait(10)


def test_a_lookup_waits_for_room_held_by_the_previous_lookups_loads(tmp_path: Path) -> None:
    """Observed: back-to-back lookups of prompts in L2, with L1 holding one prompt, answered 0
    for the second because every slot was pinned by the first one's loads (still in flight for
    a few milliseconds). A lookup now waits, briefly and bounded, for that room."""
    other = [t + 7_000 for t in TOKENS]
    with engine(l2_disk_path=str(tmp_path)) as writer:
        reg(writer, 1, seed=1)
        writer.store(1, TOKENS, IDS)
        writer.store(1, other, IDS)
        assert writer.flush(5)
        slot = int(writer.status()["instances"][0]["chunk_bytes"])
    sink = _HoldingLoads()  # below: an L1 of exactly one prompt (4 chunks), one slot per extent
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=4 * slot, l1_extent_bytes=slot,
                       l2_disk_path=str(tmp_path), lookup_wait_timeout_s=30.0)  # fmt: skip
    with CacheEngine(cfg, bus=sink) as e:
        try:
            reg(e, 1, seed=1)
            assert e.lookup(1, TOKENS) == len(TOKENS)  # its 4 loads hold all of L1
            assert e.status()["l1"]["pinned_chunks"] == 4
            hits: list[int] = []
            second = threading.Thread(target=lambda: hits.append(e.lookup(1, other)))
            second.start()
            deadline = time.monotonic() + 10
            while e.status()["l1"]["waiting_loaders"] == 0:  # it found no room: it waits
                assert second.is_alive() and time.monotonic() < deadline, hits
            sink.gate.set()  # the first loads land; their slots become evictable
            second.join(10)
            assert hits == [len(other)]
        finally:
            sink.gate.set()


class _HoldingFailedLoads(Sink):
    """Holds every announcement of ``event_type`` (a failing L2 load by default; with
    ``first_only`` the first one) inside its publication until ``gate`` is set: the loads'
    L1 entries stay LOADING, deterministically, while a store meets them."""

    def __init__(self, event_type: EventType = EventType.L2_LOAD_FAILED, *, first_only: bool = False) -> None:
        super().__init__()
        self.event_type = event_type
        self.first_only = first_only
        self.gate = threading.Event()
        self.held = threading.Event()

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is self.event_type and not (self.first_only and self.held.is_set()):
            self.held.set()
            self.gate.wait(10)


def _stored_then_damaged(tmp_path: Path) -> Any:
    """TOKENS stored on disk by another engine, every L2 copy then damaged (each load fails);
    returns the writer's caches."""
    with engine(l2_disk_path=str(tmp_path)) as writer:
        src = reg(writer, 1, seed=1)
        writer.store(1, TOKENS, IDS)
        assert writer.flush(5)
    files = list(tmp_path.rglob("*.kvc"))
    assert len(files) == 4
    for victim in files:
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))
    return src


def test_a_store_that_meets_a_load_which_then_fails_still_stores_that_chunk(tmp_path: Path) -> None:
    """Observed under vLLM's scheduler (``l2_read_errors``): a lookup's prefetch held a chunk
    LOADING from a corrupt L2 copy; a store of the same prompt skipped that chunk as present;
    the load then failed and dropped it, so L1 kept 3 of the 4 chunks the store was handed
    (a cache miss until some later store). The store now waits for such a chunk to settle
    and copies it itself when the load failed."""
    src = _stored_then_damaged(tmp_path)
    sink = _HoldingFailedLoads()
    with engine(sink, l2_disk_path=str(tmp_path)) as e:
        try:
            own = reg(e, 2, seed=1)  # this engine's blocks hold the prompt's true KV
            assert caches_equal(own, src)
            assert e.lookup(2, TOKENS) == len(TOKENS)  # prefetches begin; the first failure is held
            assert sink.held.wait(10)
            stored = e.store_async(2, TOKENS, IDS)
            sink.gate.set()  # the loads fail and drop their entries
            result = stored.result(10)
            assert e.flush(5)  # every load has settled
            assert result.stored_chunks + result.skipped_chunks == 4 and result.failed_chunks == 0
            assert e.lookup(2, TOKENS) == len(TOKENS)
            assert e.status()["l1"]["num_chunks"] == 4
            dst = reg(e, 3, seed=3)
            assert e.retrieve(3, TOKENS, IDS) == len(TOKENS) and caches_equal(src, dst)
        finally:
            sink.gate.set()


def test_a_store_watching_a_load_copies_nothing_once_its_instance_unregistered(tmp_path: Path) -> None:
    """The store's blocks belong to an instance that has left (a daemon unmaps them): the
    store ends with ``unregister`` (its ``MP_STORE_END`` before ``INSTANCE_UNREGISTERED``),
    and when the load it watched fails after that, nothing is copied."""
    _stored_then_damaged(tmp_path)
    sink = _HoldingFailedLoads()
    with engine(sink, l2_disk_path=str(tmp_path)) as e:
        try:
            reg(e, 2, seed=1)
            assert e.lookup(2, TOKENS) == len(TOKENS)
            assert sink.held.wait(10)
            stored = e.store_async(2, TOKENS, IDS)
            e.unregister(2)
            assert stored.done()  # its watch ended with the instance: it ends before unregister returns
            sink.gate.set()
            result = stored.result(0)
            assert e.flush(5)
            assert result.stored_chunks == 0 and result.failed_chunks + result.skipped_chunks == 4
            reg(e, 3, seed=3)
            assert e.lookup(3, TOKENS) == 0 and e.status()["l1"]["num_chunks"] == 0
            kinds = [ev.event_type for ev in sink.events]
            assert kinds.index(EventType.MP_STORE_END) < kinds.index(EventType.INSTANCE_UNREGISTERED)
        finally:
            sink.gate.set()


def test_a_store_watches_a_slow_load_no_longer_than_its_own_wait_bound(tmp_path: Path) -> None:
    """A tier that takes its time (here: a load held past the bound) must not hold a store
    longer than a wait for L1 room would (``store_wait_timeout_s``): the chunks it watched
    stay skipped, and the load failing later retakes nothing."""
    _stored_then_damaged(tmp_path)
    sink = _HoldingFailedLoads()
    with engine(sink, l2_disk_path=str(tmp_path), store_wait_timeout_s=0.3) as e:
        try:
            reg(e, 2, seed=1)
            assert e.lookup(2, TOKENS) == len(TOKENS)
            assert sink.held.wait(10)
            result = e.store_async(2, TOKENS, IDS).result(5)  # the gate is still shut
            assert not sink.gate.is_set()
            assert (result.stored_chunks, result.skipped_chunks, result.failed_chunks) == (0, 4, 0)
            sink.gate.set()
            assert e.flush(5)
            assert e.status()["l1"]["num_chunks"] == 0 and e.status()["l1"]["pinned_chunks"] == 0
        finally:
            sink.gate.set()
