"""The request value: one store or one retrieve, built and checked once where it enters.

Separate so that the engine, the daemon and an in-process caller hand each other one frozen
value instead of re-spelling a dozen arguments at every layer. A request is built at the edge:
the daemon builds it from the wire message and the caller's registration record alone
(``server.handlers``; the record carries the instance's geometry), an in-process caller
directly, against the instance's geometry (``CacheEngine.geometry``). Building it does every
check a request needs before anything is reserved or copied, once: the id counts (``max_ids``),
that the block ids cover the tokens, the token ids' type, and the range of the block ids of the
full chunks. Past it, no Python layer converts or re-checks ids: the engine only counts them
against its own geometry (``engine.instance.InstanceState.request_keys``), and the native copy
re-checks them as defence in depth. The engine takes the request (``CacheEngine.submit_store``
/ ``submit_retrieve``) and returns a future of one result record (``records.StoreResult`` /
``RetrieveResult``), which is also the daemon's reply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvcache.deadline import Deadline
from kvcache.errors import ChunkMismatchError, LimitExceededError
from kvcache.ids import Ids, Packed, RawIds, check_count, unpacked
from kvcache.keys import KeyScope
from kvcache.transfer.base import Direction


class IdBounds(Protocol):
    """What checking a request needs of its instance (its ``geometry.Geometry``)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRequest:
    """Copy the full chunks of ``token_ids`` (held in ``block_ids``) into the cache.

    ``block_ids``: the blocks of the full chunks only (a trailing partial chunk is never
    stored), checked against the instance. ``deadline``: when the caller stops waiting; no copy
    of its blocks starts later, since the engine may have reused them, and no wait lasts
    beyond it. ``after``: a CUDA event the engine recorded after writing the blocks; the copies
    wait for it on the device (``TransferJob.after``), a CPU cache refuses it.
    ``block_hashes``: the engine's own per-block hashes, passed through for KV events.
    """

    direction: ClassVar[Direction] = Direction.TO_CHUNKS
    instance_id: int
    token_ids: Ids
    block_ids: Ids
    scope: KeyScope = field(default_factory=KeyScope)
    request_id: str = ""
    deadline: Deadline | None = None
    after: Any = None
    block_hashes: Sequence[int] | None = None

    @classmethod
    def build(
        cls,
        instance_id: int,
        bounds: IdBounds,
        token_ids: RawIds | Packed,
        block_ids: RawIds | Packed,
        *,
        scope: KeyScope | None = None,
        request_id: str = "",
        deadline: Deadline | None = None,
        after: Any = None,
        block_hashes: Sequence[int] | None = None,
        max_ids: int | None = None,
    ) -> StoreRequest:
        """Check and convert; raises the typed error of the first failure, nothing done."""
        if block_hashes is not None and max_ids is not None and len(block_hashes) > max_ids:
            raise LimitExceededError(f"{len(block_hashes)} block hashes exceed --max-ids")
        tokens, blocks = _ids(bounds, token_ids, block_ids, max_ids, 0)
        return cls(
            instance_id=instance_id, token_ids=tokens, block_ids=blocks,
            scope=scope if scope is not None else KeyScope(), request_id=request_id,
            deadline=deadline, after=after, block_hashes=block_hashes,
        )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveRequest:
    """Copy the cached prefix of ``token_ids`` into ``block_ids``, leaving the first
    ``skip_tokens`` (rounded down to whole blocks) alone: the engine holds them already.

    ``block_ids`` and ``deadline`` as on ``StoreRequest``; past the deadline nothing is
    written into the blocks. No device event: the future resolves once the copy completed.
    ``await_chunks`` (at most the full chunks of ``token_ids``): leading chunks another engine
    is storing (a prefill/decode split), waited for until ``await_s`` before the copy.
    """

    direction: ClassVar[Direction] = Direction.FROM_CHUNKS
    instance_id: int
    token_ids: Ids
    block_ids: Ids
    skip_tokens: int = 0
    scope: KeyScope = field(default_factory=KeyScope)
    request_id: str = ""
    deadline: Deadline | None = None
    await_chunks: int = 0
    await_s: float = 0.0

    @classmethod
    def build(
        cls,
        instance_id: int,
        bounds: IdBounds,
        token_ids: RawIds | Packed,
        block_ids: RawIds | Packed,
        skip_tokens: int = 0,
        *,
        scope: KeyScope | None = None,
        request_id: str = "",
        deadline: Deadline | None = None,
        max_ids: int | None = None,
        await_chunks: int = 0,
        await_s: float = 0.0,
    ) -> RetrieveRequest:
        """Check and convert; raises the typed error of the first failure, nothing done."""
        tokens, blocks = _ids(bounds, token_ids, block_ids, max_ids, skip_tokens)
        if not 0 <= await_chunks <= len(tokens) // bounds.chunk_size or not await_s >= 0:
            raise ChunkMismatchError(
                f"await_chunks={await_chunks} (await_s={await_s}) is outside the "
                f"{len(tokens) // bounds.chunk_size} full chunks of {len(tokens)} tokens"
            )
        return cls(
            instance_id=instance_id, token_ids=tokens, block_ids=blocks, skip_tokens=skip_tokens,
            scope=scope if scope is not None else KeyScope(), request_id=request_id,
            deadline=deadline, await_chunks=await_chunks, await_s=await_s,
        )  # fmt: skip


Request = StoreRequest | RetrieveRequest


def _ids(
    bounds: IdBounds,
    raw_tokens: RawIds | Packed,
    raw_blocks: RawIds | Packed,
    max_ids: int | None,
    skip_tokens: int,
) -> tuple[Ids, Ids]:
    """The one check of a request's ids: counts, cover, token type, block range (of the
    blocks of the full chunks: the rest are never copied). Ids packed on the wire are counted
    before they are unpacked."""
    check_count(raw_tokens, max_ids)
    check_count(raw_blocks, max_ids)
    token_ids, block_ids = unpacked(raw_tokens), unpacked(raw_blocks)
    need = math.ceil(len(token_ids) / bounds.block_size)
    if len(block_ids) < need:
        raise ChunkMismatchError(
            f"{len(block_ids)} block ids cannot hold {len(token_ids)} tokens "
            f"(block size {bounds.block_size}: need {need})"
        )
    if skip_tokens < 0:
        raise ChunkMismatchError(f"skip_tokens must be >= 0, got {skip_tokens}")
    tokens = Ids.tokens(token_ids)
    full_blocks = len(tokens) // bounds.chunk_size * (bounds.chunk_size // bounds.block_size)
    return tokens, Ids.blocks(block_ids[:full_blocks], bounds.num_blocks)


__all__ = ["IdBounds", "Request", "RetrieveRequest", "StoreRequest"]
