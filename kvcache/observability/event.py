"""The vocabulary of everything kvcache reports: one ``EventType`` enum and one ``Event`` record.

Kept in one file so that a reader can see every observable fact at a glance; EVENTS.md
is the full metadata contract for each type and a test keeps the two in step.
Names read ``COMPONENT_OPERATION[_PHASE]``; values are dotted (``l1.keys.evicted``).

Chunk keys (``ChunkKey``) are unsigned 128-bit ints (see ``kvcache.keys``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

ChunkKey = int


class EventType(enum.Enum):
    # -- engine operations (publisher: CacheEngine) -------------------------------------
    MP_STORE_START = "mp.store.start"
    MP_STORE_END = "mp.store.end"
    MP_RETRIEVE_START = "mp.retrieve.start"
    MP_RETRIEVE_END = "mp.retrieve.end"
    MP_LOOKUP_START = "mp.lookup.start"
    MP_LOOKUP_END = "mp.lookup.end"
    # -- L1: pinned CPU pool (publisher: L1 pool / CacheEngine) -------------------------
    L1_WRITE_FINISHED = "l1.write.finished"
    L1_READ_FINISHED = "l1.read.finished"
    L1_KEYS_EVICTED = "l1.keys.evicted"
    L1_ALLOCATION_FAILED = "l1.allocation.failed"
    L1_CLEARED = "l1.cleared"
    # -- L2: disk / Redis (publisher: L2 adapters via CacheEngine) ----------------------
    L2_STORE_FINISHED = "l2.store.finished"
    L2_STORE_FAILED = "l2.store.failed"
    L2_LOAD_FINISHED = "l2.load.finished"
    L2_LOAD_FAILED = "l2.load.failed"
    L2_KEYS_EVICTED = "l2.keys.evicted"
    L2_KEYS_FOUND = "l2.keys.found"
    L2_CLEARED = "l2.cleared"
    # -- serving-engine block bookkeeping (publisher: CacheEngine / daemon) -------------
    MP_VLLM_BLOCK_ALLOCATION = "mp.vllm.block_allocation"
    MP_VLLM_END_SESSION = "mp.vllm.end_session"
    INSTANCE_UNREGISTERED = "instance.unregistered"


class BlockAllocationRecord(msgspec.Struct, frozen=True, gc=False):
    """Blocks a serving engine allocated to one request in one scheduler step.

    ``new_token_ids`` are the tokens the request gained in this step; the L0 lifecycle
    subscriber compares them with a block's previous tokens to tell reuse from eviction.
    """

    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]


class ChunkIdentity(msgspec.Struct, frozen=True, gc=False, array_like=True, omit_defaults=True):
    """What KV events announce one chunk as, kept with the chunk by a tier that persists it
    (the disk tier's record header) so a restarted daemon announces it as before.

    Written by the store path from the same facts as ``L1_WRITE_FINISHED`` (EVENTS.md), read
    back in ``L2_KEYS_FOUND``. Without ``block_hashes`` the chunk is announced as its key
    folded to 64 bits, under the hash its parent chunk was announced with; with them, as
    those engine blocks of ``block_size`` tokens under ``parent_block_hash``.
    """

    parent_key: bytes = b""
    """The chunk key just before this chunk in its prompt, 16 bytes little-endian (msgpack
    ints stop at 64 bits); empty at the prompt start."""
    token_ids: list[int] = []
    block_hashes: list[int] = []
    block_size: int = 0
    parent_block_hash: int | None = None

    @property
    def parent_chunk_key(self) -> ChunkKey | None:
        return int.from_bytes(self.parent_key, "little") if self.parent_key else None


@dataclass(slots=True)
class Event:
    """One observable fact.

    ``timestamp`` is seconds since the epoch; ``EventBus.publish`` stamps ``time.time()``
    only when it is None, so tests and replays can drive time explicitly.
    ``session_id`` groups the start and end of one operation (a request id, or an
    operation id the engine makes up).
    """

    event_type: EventType
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""
    timestamp: float | None = None


class EventSink(Protocol):
    """What the data path needs from the bus: ``publish`` that never blocks or raises.

    The engine, storage and transfer code type against this, not against ``EventBus``,
    so they never import the observability side.
    """

    def publish(self, event: Event) -> None: ...


class NullEventSink:
    """The sink used when observability is off: publishing costs one call."""

    def publish(self, event: Event) -> None:
        return None


__all__ = [
    "BlockAllocationRecord",
    "ChunkIdentity",
    "ChunkKey",
    "Event",
    "EventSink",
    "EventType",
    "NullEventSink",
]
