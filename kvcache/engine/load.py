"""The load path: lookup of the cached prefix, L2 -> L1 prefetch, and retrieve into engine blocks.

Separate from the engine facade because these three share one rule, kept in one place: the
prefix is made of chunks in L1 and chunks present in L2 (tiers asked in order), in any
alternation (a prompt's tail may stay in L1 after its head left for L2), and the first missing
chunk, refused load or failed load ends it; a retrieve waits for the loads a lookup began.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

from kvcache.engine.ids import IntArray, block_id_array, check_cover
from kvcache.engine.instance import Instance
from kvcache.engine.parts import EngineParts
from kvcache.engine.records import CopyTally, RetrieveResult
from kvcache.errors import ChunkMismatchError, DeadlineExceededError
from kvcache.observability.event import EventType, MpLookupEnd, MpLookupStart, MpRetrieveStart
from kvcache.records import ChunkKey
from kvcache.storage.l1_pool import L1Entry
from kvcache.storage.l2_async import AsyncL2
from kvcache.transfer.base import Direction, TransferResult

logger = logging.getLogger("kvcache.engine.engine")  # the engine's logger name, as before the split


class LookupHit(NamedTuple):
    """A lookup's answer: the cached prefix in tokens, and how much of it is in L2 (loading
    into L1 now). Per-tier hits are what a serving engine's metrics show about the tiers."""

    hit_tokens: int
    l2_tokens: int


def lookup(
    parts: EngineParts, inst: Instance, token_ids: IntArray, *, cache_salt: str, request_id: str
) -> LookupHit:
    """See ``CacheEngine.lookup``."""
    sid = parts.events.session(inst.instance_id, request_id)
    num_tokens = len(token_ids)
    parts.events.publish(EventType.MP_LOOKUP_START, sid, inst.meta(MpLookupStart, num_tokens=num_tokens))
    keys = inst.keys(token_ids, cache_salt)
    l1 = l2 = 0
    room_by = time.monotonic() + parts.config.lookup_wait_timeout_s
    while True:  # runs in L1 and runs loaded from L2 may alternate (a tail outlived its head)
        run = parts.pool.prefix(keys[l1 + l2 :])
        l1 += run
        rest = keys[l1 + l2 :]
        loaded = prefetch(parts, inst, rest, room_by=room_by) if rest else 0
        if not loaded:
            break
        l2 += loaded
    cs = parts.config.chunk_size
    hit = (l1 + l2) * cs
    parts.stats.record_lookup(num_tokens, hit)
    meta = inst.meta(
        MpLookupEnd, num_tokens=num_tokens, hit_tokens=hit, l1_hit_tokens=l1 * cs, l2_hit_tokens=l2 * cs
    )
    parts.events.publish(EventType.MP_LOOKUP_END, sid, meta)
    return LookupHit(hit, l2 * cs)


def prefetch(
    parts: EngineParts,
    inst: Instance,
    keys: Sequence[ChunkKey],
    deadline: float | None = None,
    room_by: float | None = None,
) -> int:
    """Start loading the leading ``keys`` found in L2 into L1; returns how many started.

    Without ``deadline`` (a lookup) no queue is waited for: a full load queue ends the prefix
    early. A retrieve passes its deadline, so a chunk its lookup promised is not lost to a busy
    queue. L1 room held by operations in flight is waited for until ``room_by`` (a lookup's
    short bound), else ``deadline``: back-to-back lookups must not find every slot pinned by
    the previous ones' loads and answer a miss for chunks L2 holds.
    """
    if not keys or not parts.tiers:
        return 0
    source: list[AsyncL2 | None] = [None] * len(keys)
    for tier in parts.tiers:
        missing = [i for i, s in enumerate(source) if s is None]
        if not missing:
            break
        for i, present in zip(missing, tier.contains([keys[i] for i in missing]), strict=True):
            if present:
                source[i] = tier
    n = next((i for i, s in enumerate(source) if s is None), len(keys))
    room = room_by if room_by is not None else deadline
    room_s = 0.0 if room is None else max(0.0, room - time.monotonic())
    entries = parts.pool.begin_load(inst.geometry, keys[:n], wait_s=room_s)
    for i, entry in enumerate(entries):
        src = source[i]
        assert src is not None

        def done(ok: bool, entry: L1Entry = entry) -> None:
            parts.pool.finish([entry], ok)

        wait_s = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not src.submit_load(entry.key, entry.tensor, done, wait_s):
            parts.pool.finish(entries[i:], False)
            return i
    return len(entries)


def retrieve_async(
    parts: EngineParts,
    inst: Instance,
    token_ids: IntArray,
    block_ids: IntArray,
    skip_tokens: int,
    *,
    cache_salt: str,
    request_id: str,
    copy_by: float | None = None,
) -> Future[RetrieveResult]:
    """See ``CacheEngine.retrieve_async``. Never raises: every error is set on the future.

    The caller's thread checks the request, pins the prefix (waiting for the L2 loads a lookup
    began, within ``retrieve_wait_timeout_s``) and submits one copy; its completion on the
    instance's completer thread releases the chunks, publishes the end event and resolves.
    """
    future: Future[RetrieveResult] = Future()
    try:
        _start_retrieve(
            parts, inst, token_ids, block_ids, skip_tokens, cache_salt, request_id, copy_by, future
        )
    except Exception as err:  # a bad request: nothing was pinned or published
        future.set_exception(err)
    return future


def _start_retrieve(
    parts: EngineParts,
    inst: Instance,
    token_ids: IntArray,
    block_ids: IntArray,
    skip_tokens: int,
    cache_salt: str,
    request_id: str,
    copy_by: float | None,
    future: Future[RetrieveResult],
) -> None:
    ctx = inst.ctx
    num_tokens = len(token_ids)
    check_cover(ctx, num_tokens, block_ids)
    if skip_tokens < 0:
        raise ChunkMismatchError(f"skip_tokens must be >= 0, got {skip_tokens}")
    bs, bpc, cs = ctx.block_size, ctx.blocks_per_chunk, parts.config.chunk_size
    keys = inst.keys(token_ids, cache_salt)
    if skip_tokens > len(keys) * cs:
        # The engine cannot already hold more of this request than the request has: a larger
        # skip is clamped, so the answer never claims tokens that do not exist.
        skip_tokens = len(keys) * cs
    if skip_tokens % bs:
        logger.info(
            "retrieve: skip_tokens=%d is not a multiple of block size %d; rounded down", skip_tokens, bs
        )
    skip_blocks = skip_tokens // bs
    skip = skip_blocks * bs
    ids = block_id_array(ctx, block_ids, len(keys) * bpc)
    sid = parts.events.session(inst.instance_id, request_id)
    start = inst.meta(MpRetrieveStart, num_tokens=num_tokens, skip_tokens=skip)
    parts.events.publish(EventType.MP_RETRIEVE_START, sid, start)
    first = skip_blocks // bpc  # the first chunk with a block to copy
    good = _acquire_ready(parts, inst, keys[first:], copy_by) if first < len(keys) else []

    def end(copies: CopyTally, error: BaseException | None, l2_tokens: int = 0) -> None:
        copied = copies.blocks * bs
        retrieved = skip + copied
        parts.stats.record_load(copies.nbytes, copies.seconds, copied)
        parts.events.retrieve_end(
            inst, sid, num_tokens, skip, retrieved, max(0, copied - l2_tokens), l2_tokens, copies,
            error is None,
        )  # fmt: skip
        if error is None:
            future.set_result(RetrieveResult(retrieved, copies.nbytes, copies.seconds))
        else:
            future.set_exception(error)

    if copy_by is not None and time.monotonic() > copy_by:
        parts.pool.release(good)  # the caller gave up: its blocks may belong to another request
        end(CopyTally(), DeadlineExceededError(
            "retrieve: its client's deadline passed before the copy could start; no byte was "
            "written into its blocks"
        ))  # fmt: skip
        return
    if not good:
        end(CopyTally(), None)
        return
    local_skip = skip_blocks - first * bpc
    sel = ids[first * bpc : (first + len(good)) * bpc]
    try:
        chunks = [e.tensor for e in good]
        job = ctx.copy_from_chunks_async(chunks, sel, skip_blocks=local_skip, start_by=copy_by)
    except Exception as err:  # the handler is closed: nothing was queued
        parts.pool.release(good)
        end(CopyTally(), err)
        return

    def copied(result: TransferResult) -> None:
        copies = CopyTally()
        copies.add(result)
        if result.error is not None:
            parts.pool.release(good)
            end(copies, result.error)
            return
        l2_tokens = sum(cs for e in good if e.from_l2)
        for e in good:
            e.from_l2 = False
        parts.pool.release(good, read_bytes=result.bytes)
        end(copies, None, l2_tokens)

    try:
        inst.completer.add(job, Direction.FROM_CHUNKS, copied)
    except Exception:  # the engine is closing: complete it here
        (result,) = ctx.transfer.wait([job])
        copied(result)


def _acquire_ready(
    parts: EngineParts, inst: Instance, keys: Sequence[ChunkKey], copy_by: float | None
) -> list[L1Entry]:
    """Pin the leading chunks of ``keys`` that are (or can be brought) in L1 and wait for
    any load still running (not past ``copy_by``); the first miss or failed load ends the list."""
    deadline = time.monotonic() + parts.config.retrieve_wait_timeout_s
    if copy_by is not None:
        deadline = min(deadline, copy_by)
    entries = parts.pool.acquire(keys)
    while len(entries) < len(keys) and prefetch(parts, inst, keys[len(entries) :], deadline):
        more = parts.pool.acquire(keys[len(entries) :])  # the loads just begun, and what follows
        if not more:  # they failed already
            break
        entries += more
    for i, entry in enumerate(entries):
        if not entry.wait(max(0.0, deadline - time.monotonic())):
            parts.pool.release(entries[i:])
            return entries[:i]
    return entries


__all__ = ["lookup", "prefetch", "retrieve_async"]
