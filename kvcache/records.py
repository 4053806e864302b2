"""Plain records shared by the data path, the wire and the event vocabulary.

Separate so that ``observability.event``, ``protocol.messages``, ``storage``, the engine and
the client name one ``ChunkKey``, one ``BlockAllocationRecord``, one ``ChunkIdentity``, one
result record per direction (``StoreResult``, ``RetrieveResult``: what the engine resolves its
future with is the daemon's reply, sent as it is) and one dtype spelling without importing each
other (and without importing torch, the bus or Prometheus: the event vocabulary must stay
light to import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

if TYPE_CHECKING:
    import torch

ChunkKey = int
"""A chunk key: an unsigned 128-bit int (``kvcache.keys``)."""


MAX_NAME = 1024
"""Longest request id, cache salt or model name a message may carry: the daemon keeps such
names (per-request lifecycle state, per-salt key hashers), so a client may not make them
megabytes long. vLLM's request ids are tens of characters."""
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class BlockAllocationRecord(msgspec.Struct, frozen=True, gc=False):
    """Blocks a serving engine allocated to one request in one scheduler step.

    ``new_token_ids`` are the tokens the request gained in this step; the L0 lifecycle
    subscriber compares them with a block's previous tokens to tell reuse from eviction.
    """

    req_id: Name
    new_block_ids: list[int]
    new_token_ids: list[int]


class LookupHit(msgspec.Struct, frozen=True, gc=False, array_like=True, omit_defaults=True):
    """A lookup's answer, the engine's and the wire's (one item of ``LookupBatchResult``): the
    cached prefix in tokens, and how much of it is in L2 (loading into L1 now). Per-tier hits
    are what a serving engine's metrics show about the tiers."""

    hit_tokens: int
    l2_hit_tokens: int = 0


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


class Reply(msgspec.Struct, omit_defaults=True, gc=False, tag_field="kind"):
    """Base of every daemon reply (the rest are in ``protocol.messages``), tagged by ``kind``;
    the wire's options: defaults stay off the wire, no GC tracking, unknown fields ignored."""


_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class StoreResult(Reply, tag="store"):
    """What a store did, in chunks; ``stored_tokens`` are the tokens newly written.

    ``num_bytes`` / ``transfer_seconds``: what its copies moved and how long they ran, from
    their ``TransferResult`` records (``engine.records.CopyTally``), so a caller (the vLLM
    connector) reports offload statistics from the one source the engine's own metrics use.
    The engine's future resolves with it and the daemon sends it as its reply: the first four
    fields stay required on the wire (an older client needs them even when 0)."""

    stored_chunks: int
    skipped_chunks: int
    failed_chunks: int
    stored_tokens: int
    num_bytes: _NonNegInt = 0
    transfer_seconds: float = 0.0


class RetrieveResult(Reply, tag="retrieve"):
    """What a retrieve did: ``retrieved_tokens`` is the prefix now valid in the engine's
    blocks (skip + copied); bytes and seconds as on ``StoreResult``.

    ``cuda_event``: an interprocess event the engine would wait on before reusing the blocks.
    Today's daemon sends none: its copy has completed when it replies. An asynchronous
    retrieve that sends one must keep the event alive until the engine says it waited
    (destroying an exported event the peer still uses is undefined behaviour in CUDA IPC)."""

    retrieved_tokens: int
    cuda_event: bytes | None = None
    num_bytes: _NonNegInt = 0
    transfer_seconds: float = 0.0


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as chunk records and wire messages spell it (``bfloat16``, not
    ``torch.bfloat16``); the daemon's IPC checks the name against what it can share."""
    return str(dtype).removeprefix("torch.")


__all__ = [
    "MAX_NAME",
    "BlockAllocationRecord",
    "ChunkIdentity",
    "ChunkKey",
    "Name",
    "Reply",
    "RetrieveResult",
    "StoreResult",
    "dtype_name",
]
