"""Lookups: the longest cached prefix of a prompt, and the L2 -> L1 prefetch of it.

Separate from ``retrieve`` (the retrieve path, which shares ``prefetch``) so each data path reads
on its own: a lookup keys the prompt, walks L1 (joining loads another request began, never
reading a chunk from L2 twice) and starts loading what L2 holds, then answers at once; the
retrieve that follows waits for those loads (``retrieve``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvcache.deadline import Deadline
from kvcache.engine.instance import InstanceState
from kvcache.engine.parts import EngineParts
from kvcache.engine.retrieve import prefetch
from kvcache.ids import RawIds
from kvcache.keys import Hashed, KeyScope
from kvcache.observability.event import EventType, MpLookupEnd, MpLookupStart
from kvcache.records import ChunkKey


class LookupHit(NamedTuple):
    """A lookup's answer: the cached prefix in tokens, and how much of it is in L2 (loading
    into L1 now). Per-tier hits are what a serving engine's metrics show about the tiers."""

    hit_tokens: int
    l2_tokens: int


def lookup(
    parts: EngineParts, inst: InstanceState, token_ids: RawIds, *, key_scope: KeyScope, request_id: str
) -> LookupHit:
    """See ``CacheEngine.lookup``."""
    return _lookup_keys(parts, inst, len(token_ids), lambda: inst.keys(token_ids, key_scope), request_id)


def lookup_many(
    parts: EngineParts, inst: InstanceState, queries: Sequence[tuple[RawIds, KeyScope, str]]
) -> list[LookupHit]:
    """``lookup`` of each (token ids, key scope, request id) in order, as one scheduler step
    asks them: prompts of one scope that share their head with the one before hash it once."""
    prior: dict[KeyScope, Hashed | None] = {}
    hits = []
    for token_ids, key_scope, request_id in queries:

        def keys(token_ids: RawIds = token_ids, key_scope: KeyScope = key_scope) -> list[ChunkKey]:
            keys, prior[key_scope] = inst.hasher(key_scope).keys_after(token_ids, prior.get(key_scope))
            return keys

        hits.append(_lookup_keys(parts, inst, len(token_ids), keys, request_id))
    return hits


def _lookup_keys(
    parts: EngineParts,
    inst: InstanceState,
    num_tokens: int,
    make_keys: Callable[[], list[ChunkKey]],
    request_id: str,
) -> LookupHit:
    sid = parts.events.session(inst.instance_id, request_id)
    parts.events.publish(EventType.MP_LOOKUP_START, sid, inst.meta(MpLookupStart, num_tokens=num_tokens))
    keys = make_keys()
    l1 = l2 = 0
    room_by = Deadline.within(parts.config.lookup_wait_timeout_s)
    while True:  # runs in L1 and runs loaded from L2 may alternate (a tail outlived its head)
        run, joined = parts.pool.resident(keys[l1 + l2 :])  # joined: loads others began
        l1 += run - joined
        l2 += joined
        rest = keys[l1 + l2 :]
        if not rest:
            break
        loaded = prefetch(parts, inst, rest, room_by=room_by)
        l2 += loaded
        # Nothing begun: a miss, unless another request began loading that chunk since we
        # looked (its load is joined on the next pass, never read a second time).
        if not loaded and not parts.pool.resident(rest[:1])[0]:
            break
    cs = inst.ctx.chunk_size
    hit = (l1 + l2) * cs
    parts.stats.record_lookup(num_tokens, hit)
    meta = inst.meta(
        MpLookupEnd, num_tokens=num_tokens, hit_tokens=hit, l1_hit_tokens=l1 * cs, l2_hit_tokens=l2 * cs
    )
    parts.events.publish(EventType.MP_LOOKUP_END, sid, meta)
    return LookupHit(hit, l2 * cs)


__all__ = ["LookupHit", "lookup", "lookup_many"]
