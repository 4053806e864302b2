"""Lookups: the longest cached prefix of a prompt, and the L2 -> L1 prefetch of it.

Separate from ``retrieve`` (the retrieve path, which shares ``prefetch``) so each data path reads
on its own: a lookup keys the prompt, walks L1 (joining loads another request began, never
reading a chunk from L2 twice) and starts loading what L2 holds, then answers at once; the
retrieve that follows waits for those loads (``retrieve``).

A lookup's hit is what a retrieve right after it can deliver. It holds no pins once it
answered, but while it loads it pins the chunks it counts and what L1 holds of the rest of
the prompt (``_Pins``): its loads take room within its tenant's share of L1
(``storage.shares``) from chunks nobody counts, then from the prompt's own tail (its end
first), never from the prefix counted; where only that prefix could give room, the load is
refused at once and the count ends there, as the retrieve's prefix would. A batch
(``lookup_many``) keeps every prompt's counted prefix pinned until it answers, so a later
prompt counts only what fits beside the earlier ones. It never waits longer than before:
only for others' pins, within ``lookup_wait_timeout_s``.
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
from kvcache.storage.l1.pool import EntryState, L1Entry, L1Pool


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
    l1, l2 = walk(parts, inst, keys, parts.pool.resident(keys), room_by)
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
    # A prompt wholly resident (in L1, or joining loads begun from L2) walks no further.
    tiers = _walk_batch(parts, inst, keyed, parts.pool.resident_many(keyed, shared), room_by)
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


def walk(
    parts: EngineParts,
    inst: InstanceState,
    keys: list[ChunkKey],
    resident: tuple[int, int],
    room_by: Deadline,
) -> tuple[int, int]:
    """The prefix of ``keys`` cached, in chunks: (in L1, in or loading from L2), given the
    first walk of L1 (``resident``). What L2 holds past L1 starts loading now (``prefetch``,
    waiting for L1 room until ``room_by``), none of it evicting a chunk counted (``_Pins``).
    The SGLang pages path (``pages.exists``) walks the same way."""
    run, joined = resident
    if not parts.tiers:  # nothing to load: L1's leading run is the prefix, nothing is evicted
        return run - joined, joined
    pins = _Pins(parts.pool)
    try:
        return pins.walk(parts, inst, keys, room_by)
    finally:
        pins.release()


def _walk_batch(
    parts: EngineParts,
    inst: InstanceState,
    keyed: list[list[ChunkKey]],
    resident: list[tuple[int, int]],
    room_by: Deadline,
) -> list[tuple[int, int]]:
    """``walk`` of each prompt not wholly resident, in order, every prompt's counted prefix
    pinned until the batch answers: a later prompt's loads never evict an earlier one's (a
    step's prompts share their tenant's room; each counts only what fits beside the others)."""
    if not parts.tiers or all(run == len(keys) for keys, (run, _) in zip(keyed, resident, strict=True)):
        return [(run - joined, joined) for run, joined in resident]  # nothing to load: nothing evicted
    pins = _Pins(parts.pool)
    try:
        whole = list(dict.fromkeys(k for keys, (run, _) in zip(keyed, resident, strict=True)
                                   if run == len(keys) for k in keys))  # fmt: skip
        got = dict(zip(whole, pins.hold(parts.pool.pin_resident(whole)), strict=True))
        return [
            (run - joined, joined) if run == len(keys) and all(got.get(k) is not None for k in keys)
            else pins.walk(parts, inst, keys, room_by)
            for keys, (run, joined) in zip(keyed, resident, strict=True)
        ]  # fmt: skip
    finally:
        pins.release()


class _Pins:
    """The chunks a lookup (or a batch of them) counted, pinned until it answers.

    A lookup holds no pins once it answered, but while it loads the L2 chunks of its prefix
    it pins what it counts and what L1 holds of the rest of the prompt, and passes them to
    ``prefetch`` as ``held``: its loads then take room from chunks nobody counts (within
    its tenant's share, ``storage.shares``), never from its own prefix, and never wait for
    those pins (``L1Pool.begin_load``). Where only the prompt's own chunks could give room,
    the chunks past the gap (its tail) are let go, end first, and the load evicts them: a
    head is worth more than a tail, and the tail is not counted. Where only the counted
    prefix could give room the load is refused and the count ends there, as a retrieve's
    prefix would (``retrieve._RetrieveOp._bring_in``)."""

    def __init__(self, pool: L1Pool) -> None:
        self.pool = pool
        self.held: list[L1Entry] = []

    def hold(self, entries: list[L1Entry | None]) -> list[L1Entry | None]:
        """Keep ``entries`` (pinned by the caller; None skipped) until ``release``."""
        self.held += [e for e in entries if e is not None]
        return entries

    def release(self) -> None:
        self.pool.release(self.held)  # head first in the policy's order, as a lookup's touch
        self.held = []

    def walk(
        self, parts: EngineParts, inst: InstanceState, keys: list[ChunkKey], room_by: Deadline
    ) -> tuple[int, int]:
        """One prompt's (in L1, in or loading from L2), its counted chunks kept pinned."""
        pool, loading = self.pool, EntryState.LOADING
        ahead = pool.pin_resident(keys)  # every chunk of the prompt L1 holds: none is evicted for a load
        counted: list[L1Entry] = []
        l2 = 0
        try:
            while (n := len(counted)) < len(keys):
                if (entry := ahead[n]) is not None:  # in L1, or loading (a load another began)
                    ahead[n] = None
                    counted.append(entry)
                    l2 += entry.state is loading
                    continue
                end = next((i for i in range(n + 1, len(keys)) if ahead[i] is not None), len(keys))
                tail = [e for e in ahead[end:] if e is not None]
                # While the prompt's tail is kept, room comes only from chunks nobody counts, at
                # once (never a wait the lookup did not make before); else the tail gives it.
                by = Deadline.within(0.0) if tail else room_by
                loaded = prefetch(parts, inst, keys[n:end], room_by=by, held=[*self.held, *counted, *tail])
                more = pool.acquire(keys[n:end])  # its loads, or loads another request began since
                counted += more
                l2 += min(loaded, len(more)) + sum(e.state is loading for e in more[loaded:])
                if len(more) < end - n and tail:  # refused (or a miss): the tail gives room, end first
                    pool.release(tail)  # (``release``'s order); a miss ends the prefix on the next pass
                    ahead[end:] = [None] * (len(keys) - end)
                elif not more:  # a miss, or a load refused where only the counted prefix could give room
                    break
        finally:
            pool.release([e for e in ahead if e is not None])  # past the prefix: not counted
            self.held += counted
        return len(counted) - l2, l2


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


__all__ = ["LookupHit", "lookup", "lookup_many", "walk"]
