"""The wire shapes of both forms, checked against raw msgpack and vLLM-documented decoders."""

from __future__ import annotations

import msgspec
import pytest

from kvcache.kv_events.messages import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    EventBatch,
    EventFactory,
    batch_decoder,
    seq_bytes,
    seq_from_bytes,
)
from tests.kv_events.router import ArrayBatch, MapBatch


def sample(fmt: str) -> bytes:
    f = EventFactory(fmt)  # type: ignore[arg-type]
    events = [
        f.stored([2**64 - 1, 5], block_size=16, medium=MEDIUM_CPU, parent_block_hash=7, token_ids=[1, 2]),
        f.removed([5], medium=MEDIUM_STORAGE),
        f.cleared(),
    ]
    return msgspec.msgpack.encode(EventBatch(1.5, events, 0))


def test_constants() -> None:
    assert (MEDIUM_CPU, MEDIUM_STORAGE) == ("CPU", "STORAGE")
    assert END_SEQ == b"\xff" * 8 and seq_from_bytes(END_SEQ) == -1
    assert seq_bytes(1) == b"\x00" * 7 + b"\x01"


def test_map_form_raw_shape() -> None:
    ts, events, rank = msgspec.msgpack.decode(sample("map"))
    assert (ts, rank) == (1.5, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],
        "parent_block_hash": 7,
        "token_ids": [1, 2],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "STORAGE"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_array_form_raw_shape() -> None:
    _, events, _ = msgspec.msgpack.decode(sample("array"))
    assert events[0] == ["BlockStored", [2**64 - 1, 5], 7, [1, 2], 16, None, "CPU", None]
    assert events[1] == ["BlockRemoved", [5], "STORAGE"]
    assert events[2] == ["AllBlocksCleared"]


@pytest.mark.parametrize(("fmt", "theirs"), [("map", MapBatch), ("array", ArrayBatch)])
def test_vllm_documented_decoders_and_ours_agree(fmt: str, theirs: type) -> None:
    payload = sample(fmt)
    a = msgspec.msgpack.Decoder(theirs).decode(payload)
    b = batch_decoder(fmt).decode(payload)  # type: ignore[arg-type]
    assert (
        [type(e).__name__.removeprefix("Old") for e in a.events]
        == [type(e).__name__.removeprefix("Array") for e in b.events]
        == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    )
    assert a.events[0].block_hashes == b.events[0].block_hashes == [2**64 - 1, 5]


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="'json'"):
        EventFactory("json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'json'"):
        batch_decoder("json")  # type: ignore[arg-type]
