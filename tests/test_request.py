"""The request value: built and checked once, at the edge; the engine takes it as it is."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine
from kvcache.errors import BlockIdError, ChunkMismatchError, LimitExceededError
from kvcache.geometry import Geometry
from kvcache.ids import Ids
from kvcache.keys import KeyScope
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.records import RetrieveResult, StoreResult
from kvcache.request import RetrieveRequest, StoreRequest
from kvcache.testing import make_kv_caches
from kvcache.transfer.base import Direction

BS, CS, NB = 4, 16, 8
TOKENS = list(range(40))  # two full chunks (8 blocks) and a partial one
BLOCKS10 = [0, 1, 2, 3, 4, 5, 6, 7, 0, 0]


def _engine() -> CacheEngine:
    e = CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l1_extent_bytes=1 << 16))
    caches = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_blocks=NB, block_size=BS)
    e.register(1, "m", caches, fmt=KVFormat.NL_X_TWO_NB_BS_NH_HS, block_size=BS)
    return e


def _geometry(e: CacheEngine) -> Geometry:
    return e.geometry(1)


def test_build_converts_once_to_read_only_int64_and_keeps_only_the_full_chunks_blocks() -> None:
    with _engine() as e:
        ids = np.arange(10, dtype=np.int32) % NB
        req = StoreRequest.build(1, _geometry(e), TOKENS, ids, request_id="r")
        assert req.direction is Direction.TO_CHUNKS and RetrieveRequest.direction is Direction.FROM_CHUNKS
        for got in (req.token_ids, req.block_ids):
            assert got.values.dtype == np.int64 and not got.values.flags.writeable
        assert len(req.token_ids) == 40 and len(req.block_ids) == 2 * CS // BS
        assert req.block_ids.bound == NB and req.token_ids.bound is None
        assert ids.flags.writeable  # the caller's own array is left alone
        ids[0] = 7  # and changing it later changes nothing in the request
        assert req.block_ids.values[0] == 0


def test_build_refuses_what_the_engine_refused_with_the_same_errors() -> None:
    with _engine() as e:
        g = _geometry(e)
        with pytest.raises(ChunkMismatchError, match="block ids cannot hold"):
            StoreRequest.build(1, g, TOKENS, list(range(7)))
        with pytest.raises(BlockIdError, match="block id 99 at position 7"):
            StoreRequest.build(1, g, TOKENS, [0, 1, 2, 3, 4, 5, 6, 99, 0, 0])
        with pytest.raises(TypeError, match="integers"):
            StoreRequest.build(1, g, [0.5] * 40, BLOCKS10)
        with pytest.raises(ChunkMismatchError, match="skip_tokens"):
            RetrieveRequest.build(1, g, TOKENS, BLOCKS10, -1)
        with pytest.raises(LimitExceededError, match="--max-ids"):
            StoreRequest.build(1, g, TOKENS, BLOCKS10, max_ids=39)
        with pytest.raises(LimitExceededError, match="block hashes"):
            StoreRequest.build(1, g, TOKENS[:16], list(range(4)), block_hashes=[1] * 5, max_ids=4)
        # A block past the full chunks is never copied, so it is not checked either (as before).
        StoreRequest.build(1, g, TOKENS, [0, 1, 2, 3, 4, 5, 6, 7, 99, 99])


def test_one_entry_per_direction_returns_the_wire_record() -> None:
    with _engine() as e:
        g = _geometry(e)
        blocks = torch.arange(10) % NB
        stored = e.submit_store(StoreRequest.build(1, g, TOKENS, blocks)).result()
        assert type(stored) is StoreResult is m.StoreResult  # one record, engine and wire
        assert (stored.stored_chunks, stored.stored_tokens) == (2, 32)
        req = RetrieveRequest.build(1, g, TOKENS, [7, 6, 5, 4, 3, 2, 1, 0, 0, 0], 4)
        got = e.submit_retrieve(req).result()
        assert type(got) is RetrieveResult is m.RetrieveResult and got.retrieved_tokens == 32
        assert e.store(1, TOKENS, list(range(10))).skipped_chunks == 2  # the thin wrapper


def test_a_request_built_for_another_geometry_is_refused() -> None:
    with _engine() as e:
        g = _geometry(e)
        other = dataclasses.replace(g, chunk_size=2 * CS)
        req = StoreRequest.build(1, other, list(range(48)), list(range(8)) * 2)  # 1 chunk, not 3
        with pytest.raises(ChunkMismatchError, match="another instance"):
            e.submit_store(req).result()


def test_a_passed_deadline_copies_nothing() -> None:
    with _engine() as e:
        late = Deadline(time.monotonic() - 1)
        req = StoreRequest.build(1, _geometry(e), TOKENS, list(range(10)), deadline=late)
        with pytest.raises(Exception, match="deadline"):
            e.submit_store(req).result()
        assert e.lookup(1, TOKENS) == 0


def test_key_scope_keys_chunks_as_the_joined_salt_did() -> None:
    """Stored chunks (and routers' views of them) were keyed by the daemon's joined salt: the
    structured scope must hash to exactly the same bytes, for every shape of it."""
    sep = "\x1f"
    cases = [
        (KeyScope(), ""),
        (KeyScope("t"), "t"),
        (KeyScope("t", "lora=a"), f"t{sep}lora=a"),
        (KeyScope("", "lora=a"), f"{sep}lora=a"),
        (KeyScope("t", "", "loopback"), f"t{sep}{sep}loopback"),
        (KeyScope("t", "x", "loopback"), f"t{sep}x{sep}loopback"),
    ]
    with _engine() as e:
        e.store(1, TOKENS, list(range(10)), cache_salt="t")
        for scope, joined in cases:
            assert scope.salt_field() == joined
        assert e.lookup(1, TOKENS, key_scope=KeyScope("t")) == 32
        assert e.lookup(1, TOKENS, key_scope=KeyScope("t", "lora=a")) == 0
    with pytest.raises(ValueError, match="x1f"):
        KeyScope(f"a{sep}b")
    with pytest.raises(ValueError, match="x1f"):
        KeyScope("a", f"{sep}b")


def test_ids_slices_stay_checked_and_deadlines_compare() -> None:
    ids = Ids.blocks([3, 1, 2, 0], 4)
    assert ids[1:3].bound == 4 and ids[1:3].values.tolist() == [1, 2]
    assert ids.runs([0, 2], 1).values.tolist() == [3, 2]
    soon, later = Deadline.within(1.0), Deadline.within(5.0)
    assert soon.earliest(later) is soon and later.earliest(soon) is soon and soon.earliest(None) is soon
    assert not soon.passed() and 0 < soon.left() <= 1.0 and Deadline(0.0).left() == 0.0
