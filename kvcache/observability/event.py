"""The vocabulary of everything kvcache reports: one ``EventType`` enum, its metadata Structs
and one ``Event`` record.

Kept in one file so that a reader can see every observable fact at a glance; EVENTS.md
is the full metadata contract for each type and a test keeps the two in step.
Names read ``COMPONENT_OPERATION[_PHASE]``; values are dotted (``l1.keys.evicted``).

Chunk keys (``ChunkKey``), ``BlockAllocationRecord`` and ``ChunkIdentity`` live in
``kvcache.records`` (the wire uses them too) and are re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import msgspec

from kvcache.records import BlockAllocationRecord, ChunkIdentity, ChunkKey


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
    L2_STORE_DECLINED = "l2.store.declined"
    L2_LOAD_FINISHED = "l2.load.finished"
    L2_LOAD_FAILED = "l2.load.failed"
    L2_CHECKSUM_FAILED = "l2.checksum.failed"
    L2_KEYS_EVICTED = "l2.keys.evicted"
    L2_KEYS_FOUND = "l2.keys.found"
    L2_CLEARED = "l2.cleared"
    # -- serving-engine block bookkeeping (publisher: CacheEngine / daemon) -------------
    MP_VLLM_BLOCK_ALLOCATION = "mp.vllm.block_allocation"
    MP_VLLM_END_SESSION = "mp.vllm.end_session"
    INSTANCE_UNREGISTERED = "instance.unregistered"
    # -- the daemon's admission (publisher: daemon) ------------------------------------
    REQUEST_REFUSED = "daemon.request.refused"
    REPLY_DROPPED = "daemon.reply.dropped"


class EventMeta(msgspec.Struct, frozen=True, gc=False):
    """Base of every event's metadata: one frozen Struct per ``EventType`` (``EVENT_META``).

    Typed so that a renamed or misspelt key fails in mypy and in the docs-contract test
    instead of silently reading as 0; frozen because one event reaches every subscriber.
    Fields are exactly EVENTS.md's key tables, in order; optional keys have defaults.
    """


class InstanceMeta(EventMeta, frozen=True, gc=False):
    """What every event about one serving-engine instance carries."""

    instance_id: int
    model_name: str


class OperationMeta(InstanceMeta, frozen=True, gc=False):
    """What every ``MP_*`` operation event carries: its instance, model and device."""

    device: str


# -- engine operations ----------------------------------------------------------------------
class MpStoreStart(OperationMeta, frozen=True, gc=False):
    num_tokens: int
    num_chunks: int


class MpStoreEnd(OperationMeta, frozen=True, gc=False):
    num_tokens: int
    stored_chunks: int
    skipped_chunks: int
    failed_chunks: int
    stored_tokens: int
    num_bytes: int
    transfer_seconds: float
    success: bool
    block_hashes: list[int] = []


class MpRetrieveStart(OperationMeta, frozen=True, gc=False):
    num_tokens: int
    skip_tokens: int


class MpRetrieveEnd(OperationMeta, frozen=True, gc=False):
    num_tokens: int
    skip_tokens: int
    retrieved_tokens: int
    l1_tokens: int
    l2_tokens: int
    missing_tokens: int
    num_bytes: int
    transfer_seconds: float
    success: bool
    awaited_tokens: int = 0
    awaited_missing_tokens: int = 0


class MpLookupStart(OperationMeta, frozen=True, gc=False):
    num_tokens: int


class MpLookupEnd(OperationMeta, frozen=True, gc=False):
    num_tokens: int
    hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int


# -- L1 -------------------------------------------------------------------------------------
class L1WriteFinished(EventMeta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int
    used_bytes: int
    capacity_bytes: int
    block_hashes: list[int] = []
    block_size: int = 0
    parent_block_hashes: list[int | None] = []
    token_ids: list[int] = []
    parent_keys: list[ChunkKey | None] = []


class L1ReadFinished(EventMeta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int


class L1KeysEvicted(EventMeta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int
    used_bytes: int
    capacity_bytes: int


class L1AllocationFailed(EventMeta, frozen=True, gc=False):
    requested_chunks: int
    num_bytes: int
    used_bytes: int
    capacity_bytes: int


class L1Cleared(EventMeta, frozen=True, gc=False):
    num_keys: int


# -- L2 -------------------------------------------------------------------------------------
class L2Meta(EventMeta, frozen=True, gc=False):
    """What every L2 event carries: the backend (``"disk"``, ``"redis"``, ``"redis-cluster"``)."""

    backend: str


class L2StoreFinished(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int
    duration_s: float


class L2StoreFailed(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    reason: str


class L2ChecksumFailed(L2Meta, frozen=True, gc=False):
    """A chunk whose bytes did not match its checksum: removed, a miss (never served)."""

    keys: list[ChunkKey]
    detail: str


class L2StoreDeclined(L2Meta, frozen=True, gc=False):
    """Stored chunks the tier's admission policy did not take (``kvcache.storage.admission``)."""

    keys: list[ChunkKey]
    num_bytes: int
    policy: str


class L2LoadFinished(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int
    duration_s: float
    identities: list[ChunkIdentity] = []


class L2LoadFailed(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    reason: str


class L2KeysEvicted(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int


class L2KeysFound(L2Meta, frozen=True, gc=False):
    keys: list[ChunkKey]
    num_bytes: int
    identities: list[ChunkIdentity | None]


class L2Cleared(L2Meta, frozen=True, gc=False):
    num_keys: int


# -- serving-engine block bookkeeping --------------------------------------------------------
class MpVllmBlockAllocation(InstanceMeta, frozen=True, gc=False):
    records: list[BlockAllocationRecord]
    block_size: int = 0
    """Engine block size in tokens; 0 when unknown."""


class MpVllmEndSession(InstanceMeta, frozen=True, gc=False):
    request_id: str


class InstanceUnregistered(InstanceMeta, frozen=True, gc=False):
    pass


class RequestRefused(EventMeta, frozen=True, gc=False):
    """A request the daemon refused (``LIMIT``) because its sender was at one of its bounds:
    the client should back off; other principals were not affected."""

    principal: str
    limit: str
    request: str
    count: int = 1
    """How many such requests (same principal, bound and request kind) this event reports:
    the daemon batches a flood's refusals, one event per turn of its loop."""


class ReplyDropped(EventMeta, frozen=True, gc=False):
    """Replies the daemon could not deliver and dropped: ``unread`` (the client's queue of
    unread replies was at ZMQ's high-water mark) or ``gone`` (its connection had closed)."""

    reason: str
    count: int = 1
    """How many (same reason) this event reports: batched per turn of the daemon's loop."""


EVENT_META: Mapping[EventType, type[EventMeta]] = MappingProxyType(
    {
        EventType.MP_STORE_START: MpStoreStart,
        EventType.MP_STORE_END: MpStoreEnd,
        EventType.MP_RETRIEVE_START: MpRetrieveStart,
        EventType.MP_RETRIEVE_END: MpRetrieveEnd,
        EventType.MP_LOOKUP_START: MpLookupStart,
        EventType.MP_LOOKUP_END: MpLookupEnd,
        EventType.L1_WRITE_FINISHED: L1WriteFinished,
        EventType.L1_READ_FINISHED: L1ReadFinished,
        EventType.L1_KEYS_EVICTED: L1KeysEvicted,
        EventType.L1_ALLOCATION_FAILED: L1AllocationFailed,
        EventType.L1_CLEARED: L1Cleared,
        EventType.L2_STORE_FINISHED: L2StoreFinished,
        EventType.L2_STORE_FAILED: L2StoreFailed,
        EventType.L2_STORE_DECLINED: L2StoreDeclined,
        EventType.L2_LOAD_FINISHED: L2LoadFinished,
        EventType.L2_LOAD_FAILED: L2LoadFailed,
        EventType.L2_CHECKSUM_FAILED: L2ChecksumFailed,
        EventType.L2_KEYS_EVICTED: L2KeysEvicted,
        EventType.L2_KEYS_FOUND: L2KeysFound,
        EventType.L2_CLEARED: L2Cleared,
        EventType.MP_VLLM_BLOCK_ALLOCATION: MpVllmBlockAllocation,
        EventType.MP_VLLM_END_SESSION: MpVllmEndSession,
        EventType.INSTANCE_UNREGISTERED: InstanceUnregistered,
        EventType.REQUEST_REFUSED: RequestRefused,
        EventType.REPLY_DROPPED: ReplyDropped,
    }
)
"""The metadata Struct each event type carries (EVENTS.md, one section each)."""


@dataclass(slots=True)
class Event:
    """One observable fact; ``metadata`` is the ``EVENT_META[event_type]`` Struct.

    ``timestamp`` is seconds since the epoch; ``EventBus.publish`` stamps ``time.time()``
    only when it is None, so tests and replays can drive time explicitly.
    ``session_id`` groups the start and end of one operation (a request id, or an
    operation id the engine makes up).
    """

    event_type: EventType
    metadata: EventMeta
    session_id: str = ""
    timestamp: float | None = None


class EventSink(Protocol):
    """What the data path needs from the bus: ``publish`` that never blocks or raises.

    The engine, storage and transfer code type against this, not against ``EventBus``,
    so they never import the observability side.
    """

    def publish(self, event: Event) -> None: ...


class NullEventBus:
    """The one null bus: the engine's default sink and the bus when observability is off.

    A null object rather than ``if enabled:`` checks in callers, so the data path and entry
    points handle "off" exactly like "on": ``publish`` costs one call and nothing else runs.
    It answers the whole ``EventBus`` surface that entry points use (start, flush, stop,
    counters), so one object serves both needs. Producers that would do extra work only to
    describe an event (decoding an identity, watching Redis evictions) skip it for this bus.
    Here, not in ``bus.py``, so the data path gets it without importing the real bus.
    """

    enabled = False
    max_queue_size = 0
    running = False
    queue_depth = 0
    dropped_events = 0
    dispatched_events = 0
    subscribers: tuple[()] = ()

    def publish(self, event: Event) -> None:
        return None

    def register_subscriber(self, subscriber: object) -> None:
        return None

    def start(self) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def stop(self, timeout: float | None = 10.0) -> None:
        return None

    def subscriber_errors(self, name: str) -> int:
        return 0

    def __enter__(self) -> NullEventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = [
    "EVENT_META",
    "BlockAllocationRecord",
    "ChunkIdentity",
    "ChunkKey",
    "Event",
    "EventMeta",
    "EventSink",
    "EventType",
    "InstanceMeta",
    "InstanceUnregistered",
    "L1AllocationFailed",
    "L1Cleared",
    "L1KeysEvicted",
    "L1ReadFinished",
    "L1WriteFinished",
    "L2ChecksumFailed",
    "L2Cleared",
    "L2KeysEvicted",
    "L2KeysFound",
    "L2LoadFailed",
    "L2LoadFinished",
    "L2Meta",
    "L2StoreDeclined",
    "L2StoreFailed",
    "L2StoreFinished",
    "MpLookupEnd",
    "MpLookupStart",
    "MpRetrieveEnd",
    "MpRetrieveStart",
    "MpStoreEnd",
    "MpStoreStart",
    "MpVllmBlockAllocation",
    "MpVllmEndSession",
    "NullEventBus",
    "OperationMeta",
    "RequestRefused",
]
