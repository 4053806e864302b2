"""CacheEngine over L1: round trips in all six layouts, lookup/retrieve semantics, errors, events."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.context import CacheContext
from kvcache.engine import CacheEngine
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    LayoutError,
    LimitExceededError,
    UnknownInstanceError,
)
from kvcache.layouts import KVCaches, KVFormat
from kvcache.observability.event import EVENT_META, BlockAllocationRecord, EventType, InstanceUnregistered
from kvcache.testing import ALL_FORMATS, ENGINE_OF, caches_equal, make_kv_caches
from tests.helpers import RecordingSink as Sink
from tests.helpers import counts

BS = 16  # engine block size used throughout
CS = 32  # chunk size: two blocks per chunk


def blocks_bytes(ctx: CacheContext, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """The bytes of each engine block, read through a context (one-block chunks)."""
    out = []
    for b in block_ids:
        (c,) = ctx.allocate_chunks(1, num_tokens=ctx.block_size)
        ctx.copy_to_chunks([b], [c])
        out.append(c.view(torch.uint8).clone())
    return out


def same_blocks(a: CacheContext, a_ids: Sequence[int], b: CacheContext, b_ids: Sequence[int]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(blocks_bytes(a, a_ids), blocks_bytes(b, b_ids), strict=True))


TOKENS = list(range(1000, 1000 + 8 * BS))  # 128 tokens = 4 chunks, fills 8 blocks


def engine(sink: Sink | None = None, l1: int = 1 << 22, **kw: Any) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=l1, l1_extent_bytes=1 << 16, **kw)
    return CacheEngine(cfg, bus=sink)


def reg(
    e: CacheEngine,
    iid: int,
    fmt: KVFormat = KVFormat.NL_X_TWO_NB_BS_NH_HS,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[KVCaches, CacheContext]:
    caches = make_kv_caches(fmt, num_blocks=8, block_size=BS, seed=seed, dtype=dtype)
    ctx = e.register(iid, "m", caches, engine=ENGINE_OF[fmt], fmt=fmt, block_size=BS)
    return caches, ctx


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_round_trip_byte_exact_all_layouts(fmt: KVFormat) -> None:
    e = engine()
    src, _ = reg(e, 1, fmt, seed=1)
    dst, _ = reg(e, 2, fmt, seed=2)
    assert not caches_equal(src, dst)
    ids = [3, 0, 7, 1, 6, 2, 5, 4]
    assert counts(e.store(1, TOKENS, ids)) == (4, 0, 0, 128)
    assert e.lookup(2, TOKENS) == 128
    assert e.retrieve(2, TOKENS, ids) == 128
    assert caches_equal(src, dst)


def test_layouts_of_one_geometry_share_chunks() -> None:
    e = engine()
    _, a = reg(e, 1, KVFormat.NL_X_TWO_NB_BS_NH_HS, seed=1)
    _, b = reg(e, 2, KVFormat.TWO_X_NL_X_NBBS_NH_HS, seed=2)  # SGLang MHA, same geometry
    reg(e, 3, KVFormat.NL_X_TWO_NB_BS_NH_HS, seed=3, dtype=torch.float16)
    e.store(1, TOKENS, list(range(8)))
    assert e.retrieve(2, TOKENS, [7, 6, 5, 4, 3, 2, 1, 0]) == 128
    assert same_blocks(a, range(8), b, [7, 6, 5, 4, 3, 2, 1, 0])
    assert e.lookup(3, TOKENS) == 0  # another dtype never shares


def test_lookup_prefix_semantics() -> None:
    e = engine()
    reg(e, 1)
    assert e.lookup(1, TOKENS) == 0
    e.store(1, TOKENS[:100], list(range(7)))  # 3 full chunks; the partial one is ignored
    assert e.lookup(1, TOKENS) == 96
    assert e.lookup(1, TOKENS[:95]) == 64
    changed = list(TOKENS)
    changed[40] += 1  # chunk 1 differs: the prefix ends at chunk 0
    assert e.lookup(1, changed) == 32
    assert e.lookup(1, TOKENS, cache_salt="tenant") == 0  # salts never share
    assert e.lookup(1, []) == 0


def test_store_skips_present_chunks_and_stats() -> None:
    e = engine()
    reg(e, 1)
    assert counts(e.store(1, TOKENS[:64], [0, 1, 2, 3])) == (2, 0, 0, 64)
    assert counts(e.store(1, TOKENS, list(range(8)))) == (2, 2, 0, 64)
    s = e.stats_snapshot()
    chunk_bytes = e.status()["instances"][0]["chunk_bytes"]
    assert s.store.ops == 2 and s.store.tokens == 128 and s.store.bytes == 4 * chunk_bytes
    assert e.stats_snapshot().is_empty()  # delta: nothing new
    assert counts(e.store(1, TOKENS, list(range(8)))) == (0, 4, 0, 0)
    assert e.stats_snapshot().store.ops == 0  # a store that moved nothing is not an operation


def test_pool_exhaustion_stores_what_fits() -> None:
    sink = Sink()
    probe = engine()
    _, ctx = reg(probe, 1)
    e = engine(sink, l1=2 * ctx.chunk_nbytes() + 512, l1_evict_watermark=1.0)
    reg(e, 1)
    r = e.store(1, TOKENS, list(range(8)))
    assert counts(r) == (2, 0, 2, 64)
    assert sink.of(EventType.L1_ALLOCATION_FAILED)[-1].metadata.requested_chunks == 2
    assert e.lookup(1, TOKENS) == 64
    end = sink.of(EventType.MP_STORE_END)[-1].metadata
    assert end.failed_chunks == 2 and end.success is True
    # at the default watermark the tail chunk leaves first, never the head of the prompt
    e3 = engine(l1=2 * ctx.chunk_nbytes() + 512)
    reg(e3, 1)
    assert e3.store(1, TOKENS[:64], [0, 1, 2, 3]).stored_chunks == 2
    assert e3.lookup(1, TOKENS) == 32


@pytest.mark.parametrize(
    "skip,expect_copied_blocks",
    [(0, range(8)), (32, range(2, 8)), (16, range(1, 8)), (40, range(2, 8)), (128, []), (500, []),
     (10**9, [])],
)  # fmt: skip
def test_retrieve_with_skip(skip: int, expect_copied_blocks: range | list[int]) -> None:
    sink = Sink()
    e = engine(sink)
    _, src = reg(e, 1, seed=1)
    _, dst = reg(e, 2, seed=2)
    e.store(1, TOKENS, list(range(8)))
    before = blocks_bytes(dst, range(8))
    got = e.retrieve(2, TOKENS, list(range(8)), skip_tokens=skip)
    aligned = min(skip, len(TOKENS)) // BS * BS  # a skip past the request is clamped to it
    assert got == 128  # never more than the request holds
    after = blocks_bytes(dst, range(8))
    srcb = blocks_bytes(src, range(8))
    for b in range(8):
        want = srcb[b] if b in expect_copied_blocks else before[b]
        assert torch.equal(after[b], want), b
    end = sink.of(EventType.MP_RETRIEVE_END)[-1].metadata
    assert end.skip_tokens == aligned and end.retrieved_tokens == got
    assert end.num_bytes == len(expect_copied_blocks) * BS * dst.bytes_per_token
    assert end.l1_tokens == len(expect_copied_blocks) * BS and end.l2_tokens == 0


def test_retrieve_partial_prefix_and_missing() -> None:
    e = engine()
    reg(e, 1, seed=1)
    _, dst = reg(e, 2, seed=2)
    e.store(1, TOKENS[:64], [0, 1, 2, 3])
    assert e.retrieve(2, TOKENS, list(range(8))) == 64
    assert e.retrieve(2, [1, 2, 3], [0]) == 0
    s = e.stats_snapshot()
    assert s.retrieve.ops == 1 and s.retrieve.tokens == 64 and s.retrieve.bytes == 64 * dst.bytes_per_token


def test_bad_requests_change_nothing() -> None:
    e = engine()
    reg(e, 1)
    with pytest.raises(ChunkMismatchError, match="block ids"):
        e.store(1, TOKENS, list(range(7)))
    with pytest.raises(BlockIdError) as info:
        e.store(1, TOKENS, [0, 1, 2, 3, 4, 5, 6, 99])
    assert isinstance(info.value, IndexError)
    with pytest.raises(BlockIdError):
        e.retrieve(1, TOKENS, [0, 1, 2, 3, 4, 5, 6, -1])
    with pytest.raises(ChunkMismatchError):
        e.retrieve(1, TOKENS, list(range(8)), skip_tokens=-1)
    assert e.lookup(1, TOKENS) == 0 and e.status()["l1"]["num_chunks"] == 0
    with pytest.raises(UnknownInstanceError):
        e.lookup(9, TOKENS)
    with pytest.raises(LayoutError) as dup:
        reg(e, 1)
    assert isinstance(dup.value, ValueError)
    e.unregister(1)
    with pytest.raises(UnknownInstanceError):
        e.unregister(1)
    reg(e, 1)  # the id is free again


def test_block_reports_are_checked_whole_before_anything_is_published() -> None:
    """Observed before: ids far beyond the cache were published as given, and the L0
    lifecycle state grew with them (1.6 GB after 90 M ids). A bad report now changes nothing."""
    sink = Sink()
    e = engine(sink, max_report_records=3)
    reg(e, 1)  # 8 blocks
    good = BlockAllocationRecord("r1", [0, 7], [5, 6])
    for bad_id in (8, 10**9, -1):
        with pytest.raises(BlockIdError, match=rf"block id {bad_id}\b") as info:
            e.report_block_allocations(1, [good, BlockAllocationRecord("r2", [1, bad_id], [])])
        assert isinstance(info.value, IndexError) and "'r2'" in str(info.value)
    with pytest.raises(LimitExceededError, match="max_report_records"):
        e.report_block_allocations(1, [good] * 4)
    with pytest.raises(LimitExceededError, match="r3"):  # more new blocks than the cache has
        e.report_block_allocations(1, [BlockAllocationRecord("r3", [0] * 9, [])])
    assert not sink.of(EventType.MP_VLLM_BLOCK_ALLOCATION)
    e.report_block_allocations(1, [good] * 3)
    (published,) = sink.of(EventType.MP_VLLM_BLOCK_ALLOCATION)
    assert published.metadata.records == [good] * 3


def _contract() -> dict[str, tuple[set[str], set[str]]]:
    """EVENTS.md's metadata tables for the engine's MP_* events: (required, optional) keys."""
    text = (Path(__file__).parents[2] / "EVENTS.md").read_text()
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        name = section.split(" ", 1)[0]
        if not name.startswith("MP_"):
            continue
        required: set[str] = set()
        optional: set[str] = set()
        for key, meaning in re.findall(r"^\| (\w+) \| [^|]+(?:\\\|[^|]+)* \| (.+) \|$", section, re.M):
            if key == "key":
                continue
            (optional if meaning.startswith("optional") else required).add(key)
        rows[name] = (required, optional)
    return rows


def test_events_follow_the_contract() -> None:
    sink = Sink()
    e = engine(sink)
    reg(e, 1, seed=1)
    reg(e, 2, seed=2)
    e.store(1, TOKENS, list(range(8)), request_id="r1")
    e.lookup(2, TOKENS)
    e.retrieve(2, TOKENS, list(range(8)), request_id="r2")
    e.report_block_allocations(1, [BlockAllocationRecord("r1", [0, 1], [5, 6])])
    e.end_session(1, "r1")
    contract = _contract()
    published = {ev.event_type.name: ev for ev in sink.events}
    assert set(contract) == {t.name for t in EventType if t.name.startswith("MP_")}
    for name, (required, optional) in contract.items():
        md = published[name].metadata
        assert type(md) is EVENT_META[EventType[name]], name
        keys = set(type(md).__struct_fields__)
        assert required <= keys <= required | optional, name
    start, end = sink.of(EventType.MP_STORE_START)[0], sink.of(EventType.MP_STORE_END)[0]
    assert start.session_id == end.session_id == "r1"
    lk = sink.of(EventType.MP_LOOKUP_START)[0]
    assert lk.session_id == sink.of(EventType.MP_LOOKUP_END)[0].session_id and lk.session_id.startswith("2-")
    assert published["MP_LOOKUP_END"].metadata.l1_hit_tokens == 128
    assert published["MP_VLLM_BLOCK_ALLOCATION"].metadata.records[0].req_id == "r1"
    assert sink.of(EventType.L1_WRITE_FINISHED)[0].metadata.keys
    assert sink.of(EventType.L1_READ_FINISHED)[0].metadata.num_bytes > 0
    e.store(1, TOKENS, list(range(8)), block_hashes=[11, 12])
    assert sink.of(EventType.MP_STORE_END)[-1].metadata.block_hashes == [11, 12]


def test_status_is_json_and_close_is_idempotent() -> None:
    with engine() as e:
        reg(e, 1)
        e.store(1, TOKENS, list(range(8)))
        st = json.loads(json.dumps(e.status()))
        assert st["instances"][0]["format"] == "NL_X_TWO_NB_BS_NH_HS"
        assert st["l1"]["num_chunks"] == 4 and st["l2"] == [] and st["chunk_size"] == CS
        assert e.flush(1)
    e.close()


def test_engine_block_hashes_ride_on_l1_write_finished() -> None:
    sink = Sink()
    e = engine(sink)
    reg(e, 1)
    half = TOKENS[: 2 * CS]  # two chunks first: the second store writes only chunks 2 and 3
    e.store(1, half, list(range(4)), block_hashes=[11, 12, 13, 14])
    hashes = [11, 12, 13, 14, 15, 16, 17, 18]
    e.store(1, TOKENS, list(range(8)), block_hashes=hashes)
    first, second = sink.of(EventType.L1_WRITE_FINISHED)
    assert first.metadata.block_hashes == [11, 12, 13, 14]
    assert first.metadata.parent_block_hashes == [None, 12]
    assert first.metadata.block_size == BS
    assert second.metadata.block_hashes == [15, 16, 17, 18]
    assert second.metadata.parent_block_hashes == [14, 16]  # the block before each chunk
    assert second.metadata.token_ids == TOKENS[2 * CS :]
    assert len(second.metadata.keys) == 2
    e.store(1, TOKENS, list(range(8)), block_hashes=[1, 2])  # too short: published without them
    e.close()


def test_unregister_tells_subscribers_the_instance_is_gone() -> None:
    sink = Sink()
    e = engine(sink)
    reg(e, 5)
    e.unregister(5)
    (gone,) = sink.of(EventType.INSTANCE_UNREGISTERED)
    assert gone.metadata == InstanceUnregistered(instance_id=5, model_name="m")
    with pytest.raises(UnknownInstanceError):
        e.unregister(5)
    assert len(sink.of(EventType.INSTANCE_UNREGISTERED)) == 1
