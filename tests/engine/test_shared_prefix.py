"""A prefix that many requests need at once is read from L2 once, and each request's copy
starts as soon as its own chunks are in L1 (issue 22 item 3).

Observed before: N lookups racing for a prefix held only on disk saw it as absent from L1,
and all but the first found its chunks taken by the first one's prefetch and answered a miss;
N retrieves arriving without a lookup each found the others' loads and copied nothing; and a
retrieve waiting for a long prefix held every later retrieve in the waiter's queue, even one
whose shorter prefix was already in L1.

Reads are counted by the disk tier's own counters (``loads``, ``load_misses``); "at the same
time" is made certain, not hoped for: the lookups meet at a barrier inside the tier's
``contains``, and loads are held inside their end announcement until the test allows them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine, RetrieveResult
from kvcache.keys import KeyScope
from kvcache.layouts import KVFormat
from kvcache.observability.event import EventType
from kvcache.records import ChunkKey
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.testing import caches_equal, make_kv_caches
from tests.engine.test_retrieve_waiter import HeldLoads
from tests.helpers import RecordingSink

BS, CS = 16, 32
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
CHUNKS = 8
TOKENS = list(range(900, 900 + CHUNKS * CS))
IDS = list(range(CHUNKS * CS // BS))
ALL = len(TOKENS)
N = 8


def caches(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(FMT, num_blocks=len(IDS), block_size=BS, seed=seed)
    assert isinstance(kv, list)
    return kv


@pytest.fixture
def on_disk(tmp_path: Path) -> list[torch.Tensor]:
    """TOKENS stored on disk by another engine; returns the caches they came from."""
    src = caches(seed=1)
    with CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 23, l2_disk_path=str(tmp_path))) as w:
        w.register(1, "m", src)
        assert w.store(1, TOKENS, IDS).stored_chunks == CHUNKS
    return src


def reader(tmp_path: Path, sink: RecordingSink | None = None, **kw: Any) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 23, l2_disk_path=str(tmp_path), **kw)
    return CacheEngine(cfg, bus=sink)


def reads(e: CacheEngine) -> int:
    """Chunk reads the disk tier served (hits and misses), once nothing is in flight."""
    assert e.flush(30)
    (disk,) = e.status()["l2"]
    return int(disk["loads"] + disk["load_misses"])


def together(n: int, call: Callable[[int], Any]) -> list[Any]:
    """Run ``call(i)`` for i < n on n threads released together; their results in order."""
    start = threading.Barrier(n)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait(30)
            out[i] = call(i)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_lookups_racing_for_a_prefix_on_disk_all_hit_and_it_is_read_once(
    tmp_path: Path, on_disk: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    met = threading.Barrier(N)
    real = DiskL2Adapter.contains

    def contains(self: DiskL2Adapter, keys: Sequence[ChunkKey]) -> list[bool]:
        met.wait(30)  # every lookup has seen the prefix absent from L1 before any load begins
        return real(self, keys)

    monkeypatch.setattr(DiskL2Adapter, "contains", contains)
    with reader(tmp_path) as e:
        for i in range(N):
            e.register(10 + i, "m", caches(seed=10 + i))
        hits = together(N, lambda i: e.lookup(10 + i, TOKENS, request_id=f"r{i}"))
        monkeypatch.setattr(DiskL2Adapter, "contains", real)
        assert hits == [ALL] * N
        assert reads(e) == CHUNKS
        got = together(N, lambda i: e.retrieve(10 + i, TOKENS, IDS))
        assert got == [ALL] * N
        assert reads(e) == CHUNKS


@pytest.mark.parametrize("looked_up", [True, False], ids=["after_lookups", "no_lookup"])
def test_retrieves_sharing_a_prefix_on_disk_read_it_once_and_all_get_it(
    tmp_path: Path, on_disk: list[torch.Tensor], looked_up: bool
) -> None:
    with reader(tmp_path) as e:
        dst = [caches(seed=10 + i) for i in range(N)]
        for i in range(N):
            e.register(10 + i, "m", dst[i])
        if looked_up:
            assert together(N, lambda i: e.lookup(10 + i, TOKENS)) == [ALL] * N
        futures: list[Future[RetrieveResult]] = together(N, lambda i: e.retrieve_async(10 + i, TOKENS, IDS))
        assert [f.result(60).retrieved_tokens for f in futures] == [ALL] * N
        assert all(caches_equal(on_disk, d) for d in dst)
        assert reads(e) == CHUNKS
        assert e.status()["l1"]["pinned_chunks"] == 0


def test_a_short_prefix_is_copied_while_a_longer_one_sharing_it_still_loads(
    tmp_path: Path, on_disk: list[torch.Tensor]
) -> None:
    sink = HeldLoads()
    with reader(tmp_path, sink, l2_workers=1, retrieve_wait_timeout_s=120.0) as e:
        try:
            long_kv, short_kv = caches(seed=2), caches(seed=3)
            e.register(2, "m", long_kv)
            e.register(3, "m", short_kv)
            short = TOKENS[: 2 * CS]
            assert e.lookup(2, TOKENS) == ALL  # eight loads, held, landing in order
            assert e.lookup(3, short) == 2 * CS  # the same two first chunks: nothing more to read
            long_f = e.retrieve_async(2, TOKENS, IDS)
            short_f = e.retrieve_async(3, short, IDS[:4])
            sink.allow(2)  # the two chunks the short prefix needs land; the rest stay held
            assert short_f.result(20).retrieved_tokens == 2 * CS
            assert not long_f.done()
            assert caches_equal([t[:4] for t in on_disk], [t[:4] for t in short_kv])
            sink.allow(CHUNKS - 2)
            assert long_f.result(60).retrieved_tokens == ALL
            assert caches_equal(on_disk, long_kv)
            assert len(sink.of(EventType.L2_LOAD_FINISHED)) == CHUNKS
        finally:
            sink.allow(1000)  # never leave an L2 worker held


def test_a_steps_lookups_in_one_call_answer_as_single_lookups_and_read_once(
    tmp_path: Path, on_disk: list[torch.Tensor]
) -> None:
    """``lookup_many`` (the daemon's ``LookupBatch``): prompts sharing the prefix on disk,
    one diverging, one salted elsewhere, one too short; each answered as ``lookup_tiers``
    answers it, and the shared chunks read from disk once."""
    queries = [
        (TOKENS, "", "a"),
        (TOKENS[: 5 * CS] + list(range(7, 7 + 3 * CS)), "", "b"),  # diverges in chunk 6
        (TOKENS, "other", "c"),  # another salt: a miss
        (TOKENS[: CS - 1], "", "d"),  # no full chunk
        (TOKENS, "", "e"),
    ]
    with reader(tmp_path) as e:
        e.register(2, "m", caches(seed=2))
        hits = e.lookup_many(2, [(np.asarray(t, dtype=np.uint32), KeyScope(s), r) for t, s, r in queries])
        assert [h.hit_tokens for h in hits] == [ALL, 5 * CS, 0, 0, ALL]
        assert hits[0].l2_hit_tokens == ALL  # the first read it; the last found it in L1
        assert reads(e) == CHUNKS
        again = [e.lookup_tiers(2, t, cache_salt=s, request_id=r) for t, s, r in queries]
        assert [h.hit_tokens for h in again] == [h.hit_tokens for h in hits]
        assert reads(e) == CHUNKS


def test_a_batch_reports_each_lookup_as_single_lookups_do(
    tmp_path: Path, on_disk: list[torch.Tensor]
) -> None:
    """The batch walks L1 once and records the statistics once, but what it reports is what
    the same lookups asked one by one report: an ``MP_LOOKUP_START`` and an ``MP_LOOKUP_END``
    per prompt under its request id, with the same metadata, and the same lookup statistics.
    The prompts need the L2 walk (the first reads the prefix from disk, the rest join its
    loads or find it in L1 by then: how a hit splits between L1 and L2 depends on how far
    those loads got, in either form, so only their sum is compared)."""
    queries = [
        (TOKENS, "", "a"),
        (TOKENS[: 5 * CS] + list(range(7, 7 + 3 * CS)), "", "b"),
        (TOKENS, "other", "c"),
        (TOKENS[: CS - 1], "", "d"),
        (TOKENS, "", "e"),
    ]

    def reported(batch: bool) -> tuple[list[tuple[str, str, dict[str, Any]]], tuple[int, int, int]]:
        sink = RecordingSink()
        with reader(tmp_path, sink) as e:  # a fresh engine each: an empty L1, the disk tier
            e.register(2, "m", caches(seed=2))
            asked = [(np.asarray(t, dtype=np.uint32), KeyScope(s), r) for t, s, r in queries]
            if batch:
                e.lookup_many(2, asked)
            else:
                for t, scope, r in asked:
                    e.lookup_tiers(2, t, cache_salt=scope.salt, request_id=r)
            stats = e.stats_snapshot()
            types = (EventType.MP_LOOKUP_START, EventType.MP_LOOKUP_END)
            events = []
            for ev in sink.events:
                if ev.event_type in types:
                    fields = msgspec.structs.asdict(ev.metadata)
                    if ev.event_type is EventType.MP_LOOKUP_END:
                        assert (
                            fields.pop("l1_hit_tokens") + fields.pop("l2_hit_tokens") == fields["hit_tokens"]
                        )
                    events.append((ev.session_id, ev.event_type.name, fields))
            events.sort(key=lambda e: (e[0], e[1]))
        return events, (stats.lookups, stats.lookup_query_tokens, stats.lookup_hit_tokens)

    batch_events, batch_stats = reported(True)
    single_events, single_stats = reported(False)
    assert len(batch_events) == 2 * len(queries)
    assert batch_events == single_events
    assert batch_stats == single_stats == (5, sum(len(t) for t, _, _ in queries), 2 * ALL + 5 * CS)
