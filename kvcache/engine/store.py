"""The store path: engine blocks -> fresh L1 slots, then written through to every L2 tier.

Separate from the engine facade because it is the one path that reserves memory and owns the
write-through pins: each chunk newly written to L1 stays pinned once per tier until that tier's
write finishes (or is refused), so a slot is never evicted or reused while a tier reads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import numpy as np

from kvcache.engine.ids import IntArray, block_id_array, check_cover
from kvcache.engine.instance import Instance
from kvcache.engine.op_events import chunk_identities, chunk_write_metadata
from kvcache.engine.parts import EngineParts
from kvcache.errors import DeadlineExceededError
from kvcache.observability.event import ChunkKey, EventType
from kvcache.storage.l1_pool import L1Entry


class StoreResult(msgspec.Struct, frozen=True):
    """What a store did, in chunks; ``stored_tokens`` are the tokens newly written."""

    stored_chunks: int = 0
    skipped_chunks: int = 0
    failed_chunks: int = 0
    stored_tokens: int = 0


def store(
    parts: EngineParts,
    inst: Instance,
    token_ids: IntArray,
    block_ids: IntArray,
    *,
    cache_salt: str,
    request_id: str,
    block_hashes: Sequence[int] | None,
    copy_by: float | None = None,
) -> StoreResult:
    """See ``CacheEngine.store``.

    Chunks are reserved, copied and written through in batches: when L1 runs out while this
    store holds fresh slots, it writes those through first and then asks for the rest, so it
    only ever waits (within ``store_wait_timeout_s``, in all) holding nothing of its own.
    Without an L2 tier there is nothing to write through, and the first shortage ends it.
    """
    ctx = inst.ctx
    num_tokens = len(token_ids)
    check_cover(ctx, num_tokens, block_ids)
    keys = inst.keys(token_ids, cache_salt)
    ids = block_id_array(ctx, block_ids, len(keys) * ctx.blocks_per_chunk)
    sid = parts.events.session(inst.instance_id, request_id)
    start = inst.meta(num_tokens=num_tokens, num_chunks=len(keys))
    parts.events.publish(EventType.MP_STORE_START, sid, start)
    deadline = time.monotonic() + parts.config.store_wait_timeout_s
    if copy_by is not None:
        deadline = min(deadline, copy_by)
    stored = skipped = failed = pos = 0
    elapsed = 0.0
    while pos < len(keys):
        left = max(0.0, deadline - time.monotonic())
        res = parts.pool.begin_write(inst.geometry, keys[pos:], wait_s=left, partial=bool(parts.tiers))
        new = [e for _, e in res.new]
        skipped += len(res.present)
        failed += res.failed
        if copy_by is not None and time.monotonic() > copy_by and (new or res.failed):
            # The caller gave up (its blocks may hold another request's KV by now): copy
            # nothing more, and say why the rest is not stored.
            parts.pool.finish(new, False)
            cs = parts.config.chunk_size
            late = StoreResult(stored, skipped, len(keys) - stored - skipped, stored * cs)
            parts.events.store_end(inst, sid, num_tokens, late, 0, elapsed, False)
            raise DeadlineExceededError(
                f"store: its client's deadline passed before chunk {pos} could be copied "
                f"({stored} chunks stored before it); the rest was not copied"
            )
        if new:
            indices = [pos + i for i, _ in res.new]
            try:
                seconds, metas = _copy_in(parts, inst, ids, keys, indices, new, token_ids, block_hashes)
                elapsed += seconds
            except Exception:  # earlier batches stay stored; the rest of the request is lost
                cs = parts.config.chunk_size
                lost = StoreResult(stored, skipped, len(keys) - stored - skipped, stored * cs)
                parts.events.store_end(inst, sid, num_tokens, lost, 0, elapsed, False)
                raise
            _write_through(parts, new, deadline, metas)
        stored += len(new)
        pos += res.settled
    result = StoreResult(stored, skipped, failed, stored * parts.config.chunk_size)
    nbytes = stored * inst.geometry.nbytes
    parts.stats.record_store(nbytes, elapsed, result.stored_tokens)
    parts.events.store_end(inst, sid, num_tokens, result, nbytes, elapsed, True, block_hashes)
    return result


def _copy_in(
    parts: EngineParts,
    inst: Instance,
    ids: np.ndarray,
    keys: list[ChunkKey],
    chunk_indices: list[int],
    new: list[L1Entry],
    token_ids: IntArray,
    block_hashes: Sequence[int] | None,
) -> tuple[float, list[bytes]]:
    """Copy the engine blocks of ``chunk_indices`` into their fresh slots and publish them
    (pinned once per tier for the write-through first); returns the copy's seconds and, when
    a tier keeps them, each chunk's encoded ``ChunkIdentity``. On a failed copy the slots are
    freed and the error propagates."""
    ctx = inst.ctx
    bpc = ctx.blocks_per_chunk
    sel = np.concatenate([ids[i * bpc : (i + 1) * bpc] for i in chunk_indices])
    t0 = time.perf_counter()
    try:
        ctx.copy_to_chunks(sel, [e.tensor for e in new])
    except Exception:
        parts.pool.finish(new, False)
        raise
    elapsed = time.perf_counter() - t0
    for _tier in parts.tiers:  # the write-through pins, taken before the slots go public
        parts.pool.pin(new)
    extra = chunk_write_metadata(
        keys, chunk_indices, bpc, ctx.block_size, parts.config.chunk_size, token_ids, block_hashes
    )
    parts.pool.finish(new, True, extra)
    keep = any(tier.adapter.keeps_meta for tier in parts.tiers)
    return elapsed, chunk_identities(extra, parts.config.chunk_size) if keep else []


def _write_through(parts: EngineParts, entries: list[L1Entry], deadline: float, metas: list[bytes]) -> None:
    """Queue each new chunk to every tier; a busy tier gets until ``deadline`` (the store's
    own wait bound) to make room, so a burst of stores is slowed down rather than dropped.
    ``metas`` (aligned with ``entries``, or empty) go to the tiers that keep them."""
    for tier in parts.tiers:
        for i, entry in enumerate(entries):

            def done(ok: bool, entry: L1Entry = entry) -> None:
                parts.pool.release([entry])

            wait_s = max(0.0, deadline - time.monotonic())
            meta = metas[i] if metas and tier.adapter.keeps_meta else b""
            if not tier.submit_store(entry.key, entry.tensor, done, wait_s, meta):
                parts.pool.release([entry])


__all__ = ["StoreResult", "store"]
