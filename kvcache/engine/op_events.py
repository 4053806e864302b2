"""The engine's operation events: session ids and the metadata of the MP_* start/end events.

Separate from the data paths so the keys every store and retrieve reports (docs/event-contract.md)
are written in one place, whichever path (or failure branch) publishes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np

from kvcache.engine.instance import InstanceState
from kvcache.engine.records import CopyTally
from kvcache.ids import RawIds
from kvcache.observability.event import (
    Event,
    EventMeta,
    EventSink,
    EventType,
    L1WriteFinished,
    MpRetrieveEnd,
    MpStoreEnd,
    NullEventBus,
)
from kvcache.records import ChunkIdentity, ChunkKey, StoreResult


class OpEvents:
    """Publishes one engine operation's events on ``bus`` under its session id."""

    def __init__(self, bus: EventSink) -> None:
        self.bus = bus
        #: False for the null bus: a path that builds an event's metadata only to publish
        #: it may skip both (a lookup batch builds two per prompt), as the L2 tiers do.
        self.on = not isinstance(bus, NullEventBus)
        self._ops = itertools.count()

    def session(self, instance_id: int, request_id: str) -> str:
        """The request's own id, or a fresh one (``<instance>-<n>``) when it has none."""
        return request_id or f"{instance_id}-{next(self._ops)}"

    def publish(self, etype: EventType, sid: str, meta: EventMeta) -> None:
        self.bus.publish(Event(etype, meta, session_id=sid))

    def store_end(
        self,
        inst: InstanceState,
        sid: str,
        num_tokens: int,
        r: StoreResult,
        copies: CopyTally,
        success: bool,
        block_hashes: Sequence[int] | None = None,
    ) -> None:
        """``num_bytes`` and ``transfer_seconds`` are the copies' ``TransferResult`` sums."""
        meta = inst.meta(
            MpStoreEnd,
            num_tokens=num_tokens,
            stored_chunks=r.stored_chunks,
            skipped_chunks=r.skipped_chunks,
            failed_chunks=r.failed_chunks,
            stored_tokens=r.stored_tokens,
            num_bytes=copies.nbytes,
            transfer_seconds=copies.seconds,
            success=success,
            block_hashes=list(block_hashes) if block_hashes is not None else [],
        )
        self.publish(EventType.MP_STORE_END, sid, meta)

    def retrieve_end(
        self,
        inst: InstanceState,
        sid: str,
        num_tokens: int,
        skip: int,
        retrieved: int,
        l1_tokens: int,
        l2_tokens: int,
        copies: CopyTally,
        success: bool,
        awaited: int = 0,
    ) -> None:
        meta = inst.meta(
            MpRetrieveEnd,
            num_tokens=num_tokens,
            skip_tokens=skip,
            retrieved_tokens=retrieved,
            l1_tokens=l1_tokens,
            l2_tokens=l2_tokens,
            missing_tokens=max(0, num_tokens - retrieved),
            num_bytes=copies.nbytes,
            transfer_seconds=copies.seconds,
            success=success,
            awaited_tokens=awaited,
            awaited_missing_tokens=max(0, awaited - retrieved),
        )
        self.publish(EventType.MP_RETRIEVE_END, sid, meta)


def chunk_write_metadata(
    keys: Sequence[ChunkKey],
    chunk_indices: list[int],
    bpc: int,
    block_size: int,
    chunk_size: int,
    token_ids: RawIds,
    block_hashes: Sequence[int] | None,
) -> L1WriteFinished:
    """The ``L1_WRITE_FINISHED`` facts that tell KV-event routers what the written chunks are
    (EVENTS.md): the chunk key before each in its prompt (``parent_keys``), their tokens and,
    when the store carried the engine's own block hashes that cover the chunks, those hashes.
    A template: the L1 pool fills in the keys, bytes and occupancy when the write lands."""
    tokens = np.asarray(token_ids)
    parts = [tokens[i * chunk_size : (i + 1) * chunk_size] for i in chunk_indices]
    parent_keys: list[ChunkKey | None] = [keys[i - 1] if i > 0 else None for i in chunk_indices]
    token_list: list[int] = np.concatenate(parts).tolist() if parts else []
    base = L1WriteFinished(
        keys=[], num_bytes=0, used_bytes=0, capacity_bytes=0, token_ids=token_list, parent_keys=parent_keys
    )
    if block_hashes is None or (chunk_indices and len(block_hashes) < (max(chunk_indices) + 1) * bpc):
        return base
    hashes: list[int] = []
    parents: list[int | None] = []
    for i in chunk_indices:
        hashes.extend(int(h) for h in block_hashes[i * bpc : (i + 1) * bpc])
        parents.append(int(block_hashes[i * bpc - 1]) if i > 0 else None)
    return msgspec.structs.replace(
        base, block_hashes=hashes, block_size=block_size, parent_block_hashes=parents
    )


def chunk_identities(facts: L1WriteFinished, chunk_size: int) -> list[bytes]:
    """Per written chunk, its encoded ``ChunkIdentity``: the ``chunk_write_metadata`` facts of
    that chunk, for the tiers that keep them with the chunk (``L2Adapter.keeps_meta``)."""
    tokens, hashes, parents = facts.token_ids, facts.block_hashes, facts.parent_block_hashes
    out: list[bytes] = []
    n = len(facts.parent_keys)
    bpc = len(hashes) // n if n else 0
    for i, parent_key in enumerate(facts.parent_keys):
        ident = ChunkIdentity(
            parent_key=parent_key.to_bytes(16, "little") if parent_key is not None else b"",
            token_ids=tokens[i * chunk_size : (i + 1) * chunk_size],
            block_hashes=hashes[i * bpc : (i + 1) * bpc],
            block_size=facts.block_size if bpc else 0,
            parent_block_hash=parents[i] if bpc else None,
        )
        try:
            out.append(msgspec.msgpack.encode(ident))
        except (OverflowError, msgspec.EncodeError):  # an engine hash beyond 64 bits
            out.append(b"")  # stored without: a restart announces it by key
    return out


__all__ = ["OpEvents", "chunk_identities", "chunk_write_metadata"]
