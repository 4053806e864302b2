"""The KV-event wire messages, compatible with vLLM's ``vllm/distributed/kv_events.py``.

Kept apart from the publisher so a router (or a test) can decode the stream by importing
only this module: it needs msgspec and nothing else from kvcache.

Wire shape (one ZMQ message per batch)::

    frames  = [topic, seq (8-byte big-endian, from 0), payload]
    payload = msgpack EventBatch = [ts, events, data_parallel_rank]

Events are tagged unions of ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``:

* **map form** (vLLM >= 0.24, the default): each event is a map with its class name under
  the key ``"type"``: ``{"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU"}``;
* **array form** (vLLM <= 0.23): each event is an array whose first element is the class
  name, then the fields in declaration order: ``["BlockRemoved", [...], "CPU"]``.

Field names and order follow vLLM; fields only ever grow at the end, with defaults (which
``omit_defaults`` keeps off the wire), so an older decoder keeps working.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

#: ``medium`` of chunks held in kvcache's CPU pool (L1).
MEDIUM_CPU = "CPU"
#: ``medium`` of chunks held in an L2 tier (local disk, Redis).
MEDIUM_STORAGE = "STORAGE"
#: Sequence number of the replay end marker (sent with an empty payload).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

EventFormat = Literal["map", "array"]
FORMATS: tuple[EventFormat, ...] = ("map", "array")


def seq_bytes(seq: int) -> bytes:
    """A sequence number as it travels: 8 bytes, big-endian, signed (so ``END_SEQ`` is -1)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One batch: every event of one engine operation, or of several consecutive ones merged
    in order by the publisher. ``ts`` is seconds since the epoch (of the latest operation)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# -- map form (vLLM >= 0.24) ------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-form events; the tag (class name) travels under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks that became present in ``medium``; ``block_hashes`` are in prefix order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    """Retired upstream in favour of ``lora_name``; kept for wire compatibility (always None)."""
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that left ``medium``."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything this publisher announced is gone (a tier was cleared)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- array form (vLLM <= 0.23) ----------------------------------------------------------------


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-form events; the tag is the first array element."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


AnyEvent = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | ArrayBlockStored
    | ArrayBlockRemoved
    | ArrayAllBlocksCleared
)


class EventFactory:
    """Builds the events of one wire form, so callers never switch on the format."""

    def __init__(self, fmt: EventFormat = "map") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown KV event format {fmt!r} (known: {', '.join(FORMATS)})")
        self.format = fmt

    def stored(
        self,
        block_hashes: list[int],
        *,
        block_size: int,
        medium: str,
        parent_block_hash: int | None = None,
        token_ids: list[int] | None = None,
    ) -> AnyEvent:
        cls = BlockStored if self.format == "map" else ArrayBlockStored
        return cls(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=token_ids if token_ids is not None else [],
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def removed(self, block_hashes: list[int], *, medium: str) -> AnyEvent:
        if self.format == "map":
            return BlockRemoved(block_hashes=block_hashes, medium=medium)
        return ArrayBlockRemoved(block_hashes=block_hashes, medium=medium)

    def cleared(self) -> AnyEvent:
        return AllBlocksCleared() if self.format == "map" else ArrayAllBlocksCleared()


def batch_decoder(fmt: EventFormat = "map") -> msgspec.msgpack.Decoder[Any]:
    """A decoder of payloads in ``fmt``: returns a ``KVEventBatch``/``ArrayKVEventBatch``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV event format {fmt!r} (known: {', '.join(FORMATS)})")
    return msgspec.msgpack.Decoder(KVEventBatch if fmt == "map" else ArrayKVEventBatch)


__all__ = [
    "END_SEQ",
    "FORMATS",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "AnyEvent",
    "ArrayAllBlocksCleared",
    "ArrayBlockRemoved",
    "ArrayBlockStored",
    "ArrayKVCacheEvent",
    "ArrayKVEventBatch",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFactory",
    "EventFormat",
    "KVCacheEvent",
    "KVEventBatch",
    "batch_decoder",
    "seq_bytes",
    "seq_from_bytes",
]
