"""Lookups: the longest cached prefix of a prompt, and the L2 -> L1 prefetch of it.

Separate from ``retrieve`` (the retrieve path, which shares ``prefetch``) so each data path reads
on its own: a lookup keys the prompt, walks L1 (joining loads another request began, never
reading a chunk from L2 twice) and starts loading what L2 holds, then answers at once; the
retrieve that follows waits for those loads (``retrieve``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.deadline import Deadline
from kvcache.engine.instance import InstanceState
from kvcache.engine.parts import EngineParts
from kvcache.engine.retrieve import prefetch
from kvcache.ids import Packed, RawIds, id_count, is_packed, unpacked
from kvcache.keys import KeyScope, u32_bytes
from kvcache.observability.event import EventType, MpLookupEnd, MpLookupStart
from kvcache.records import ChunkKey, LookupHit


def lookup(
    parts: EngineParts, inst: InstanceState, token_ids: RawIds, *, key_scope: KeyScope, request_id: str
) -> LookupHit:
    """See ``CacheEngine.lookup``."""
    sid = parts.events.session(inst.instance_id, request_id)
    if parts.events.on:
        meta = inst.meta(MpLookupStart, num_tokens=len(token_ids))
        parts.events.publish(EventType.MP_LOOKUP_START, sid, meta)
    keys = inst.keys(token_ids, key_scope)
    room_by = Deadline.within(parts.config.lookup_wait_timeout_s)
    l1, l2 = _walk(parts, inst, keys, parts.pool.resident(keys), room_by)
    parts.stats.record_lookup(len(token_ids), (l1 + l2) * inst.ctx.chunk_size)
    return _answer(parts, inst, sid, len(token_ids), l1, l2)


def lookup_many(
    parts: EngineParts, inst: InstanceState, queries: Sequence[tuple[RawIds | Packed, KeyScope, str]]
) -> list[LookupHit]:
    """``lookup`` of each (token ids, key scope, request id) in order, as one scheduler step
    asks them, at a fraction of the cost per prompt: prompts of one scope that share their
    head with the one before hash it once, L1 is walked for all under one hold of its lock,
    and the statistics are recorded once. Only a prompt not wholly in L1 walks again on its
    own (L2, loads begun by others). Each prompt's ``MP_LOOKUP_START`` is published before the
    batch is served and its ``MP_LOOKUP_END`` after (the requester waited for the batch); on
    a bus that is off, nothing is built to describe them."""
    events = parts.events
    sizes = [id_count(token_ids) for token_ids, _, _ in queries]
    sids: list[str] = []
    if events.on:
        sids = [events.session(inst.instance_id, request_id) for _, _, request_id in queries]
        for sid, size in zip(sids, sizes, strict=True):
            events.publish(EventType.MP_LOOKUP_START, sid, inst.meta(MpLookupStart, num_tokens=size))
    keyed, shared = _keys(inst, queries)
    room_by = Deadline.within(parts.config.lookup_wait_timeout_s)  # one bound for the batch
    tiers = [
        (run - joined, joined) if run == len(keys) else _walk(parts, inst, keys, (run, joined), room_by)
        for keys, (run, joined) in zip(keyed, parts.pool.resident_many(keyed, shared), strict=True)
    ]  # a prompt wholly resident (in L1, or joining loads begun from L2) walks no further
    cs = inst.ctx.chunk_size
    parts.stats.record_lookups(len(tiers), sum(sizes), sum(l1 + l2 for l1, l2 in tiers) * cs)
    if not events.on:
        return [LookupHit((l1 + l2) * cs, l2 * cs) for l1, l2 in tiers]
    return [_answer(parts, inst, sid, n, l1, l2) for sid, n, (l1, l2) in zip(sids, sizes, tiers, strict=True)]


def _keys(
    inst: InstanceState, queries: Sequence[tuple[RawIds | Packed, KeyScope, str]]
) -> tuple[list[list[ChunkKey]], list[int]]:
    """Each prompt's chunk keys, and how many leading keys it shares with the prompt just
    before it (``L1Pool.resident_many`` walks that head once). Consecutive prompts of one
    scope are hashed in one call (``ChunkHasher.keys_of_run``); ids packed as uint32 (the
    daemon's, off the wire) are hashed as they came. A prompt with an id past uint32 is
    hashed alone and shares nothing."""
    wire = _one_wire_run(queries)
    if wire is not None:  # the daemon's batch of one scope: hashed in one call, as it came
        return inst.hasher(queries[0][1]).keys_of_run(wire)
    keyed: list[list[ChunkKey]] = []
    shared: list[int] = []
    run: list[bytes | memoryview] = []
    scope: KeyScope | None = None

    def hash_run() -> None:
        if run and scope is not None:
            keys, same = inst.hasher(scope).keys_of_run(run)  # the first shares nothing
            keyed.extend(keys)
            shared.extend(same)
            run.clear()

    for token_ids, key_scope, _ in queries:
        buf = _u32(token_ids)
        if key_scope != scope or buf is None:
            hash_run()
            scope = key_scope
        if buf is None:
            ids = unpacked(token_ids) if is_packed(token_ids) else token_ids
            keyed.append(inst.hasher(key_scope).keys(ids))
            shared.append(0)
        else:
            run.append(buf)
    hash_run()
    return keyed, shared


def _one_wire_run(queries: Sequence[tuple[RawIds | Packed, KeyScope, str]]) -> list[bytes] | None:
    """Every prompt's uint32 bytes when all are packed so (off the wire) under one scope
    object (the daemon builds one per salt and key extra), else None."""
    if not queries:
        return None
    first = queries[0][1]
    out: list[bytes] = []
    for token_ids, key_scope, _ in queries:
        if key_scope is not first or not is_packed(token_ids) or token_ids.width != 4:
            return None
        out.append(token_ids.data)
    return out


def _u32(token_ids: RawIds | Packed) -> bytes | memoryview | None:
    """The ids as little-endian uint32 bytes, or None when one is past uint32."""
    if is_packed(token_ids):
        if token_ids.width == 4:
            return token_ids.data
        token_ids = unpacked(token_ids)
    return u32_bytes(token_ids)


def _walk(
    parts: EngineParts,
    inst: InstanceState,
    keys: list[ChunkKey],
    resident: tuple[int, int],
    room_by: Deadline,
) -> tuple[int, int]:
    """The prefix of ``keys`` cached, in chunks: (in L1, in or loading from L2), given the
    first walk of L1 (``resident``). What L2 holds past L1 starts loading now (``prefetch``,
    waiting for L1 room until ``room_by``)."""
    run, joined = resident  # joined: loads others began
    l1, l2 = run - joined, joined
    while l1 + l2 < len(keys):  # runs in L1 and runs loaded from L2 may alternate
        rest = keys[l1 + l2 :]
        loaded = prefetch(parts, inst, rest, room_by=room_by)
        l2 += loaded
        # Nothing begun: a miss, unless another request began loading that chunk since we
        # looked (its load is joined on the next pass, never read a second time).
        if not loaded and not parts.pool.resident(rest[:1])[0]:
            break
        run, joined = parts.pool.resident(keys[l1 + l2 :])
        l1 += run - joined
        l2 += joined
    return l1, l2


def _answer(
    parts: EngineParts, inst: InstanceState, sid: str, num_tokens: int, l1: int, l2: int
) -> LookupHit:
    """Publish ``MP_LOOKUP_END`` (the caller recorded the statistics) and answer."""
    cs = inst.ctx.chunk_size
    hit = (l1 + l2) * cs
    if not parts.events.on:
        return LookupHit(hit, l2 * cs)
    meta = inst.meta(
        MpLookupEnd, num_tokens=num_tokens, hit_tokens=hit, l1_hit_tokens=l1 * cs, l2_hit_tokens=l2 * cs
    )
    parts.events.publish(EventType.MP_LOOKUP_END, sid, meta)
    return LookupHit(hit, l2 * cs)


__all__ = ["LookupHit", "lookup", "lookup_many"]
