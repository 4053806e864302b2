"""Pages keyed by the serving engine: SGLang HiCache's per-page keys over the same L1/L2 tiers.

Separate from ``store``/``retrieve`` because the keys come from the engine, not from token ids:
SGLang names each page by a SHA-256 chained over the prompt's pages, so every key already names
its whole prefix and a page can be stored, found and copied without its predecessors. The
instance is registered with one page per chunk (``CacheEngine.register(chunk_size=page)``);
everything after the keys is the chunk machinery: ``_StoreOp`` (L1 reservation, copies on the
completer, write-through to every tier), ``_RetrieveOp`` (pins, waits for L2 loads on the
retrieve waiter) and ``prefetch``, with their events and statistics.

Key definition (page key version 1), for a 32-byte engine page key ``k``::

    root = root_key_bytes(model, salt, instance scope || b"|pages.v1")
    key  = blake2b(root || b"\\x20" || k, digest_size=16, person=PERSON)

The scope holds the chunk geometry (KV, layers, page tokens, width, dtype), so pages of another
shape or dtype never match; ``model`` and ``salt`` (the tenant's) scope them like chunk keys.
The ``|pages.v1`` root and the ``\\x20`` tag (token chunks use ``\\x04``/``\\x08``) keep page
keys and token-chunk keys apart: the two can never name the same bytes, so a vLLM chunk is never
served to SGLang or the other way round (it could not be anyway: the prefixes are hashed
differently, SHA-256 over token pages against blake2b over token chunks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future

from kvcache.deadline import Deadline
from kvcache.engine import retrieve as retrieve_path
from kvcache.engine.instance import InstanceState
from kvcache.engine.parts import EngineParts
from kvcache.engine.retrieve import _RetrieveOp
from kvcache.engine.store import _StoreOp
from kvcache.errors import ChunkMismatchError
from kvcache.futures import failed
from kvcache.ids import Ids, RawIds
from kvcache.keys import KEY_BYTES, PERSON, root_key_bytes
from kvcache.observability.event import EventType, MpLookupEnd, MpLookupStart, MpRetrieveStart, MpStoreStart
from kvcache.records import ChunkKey, RetrieveResult, StoreResult
from kvcache.request import StoreRequest

PAGE_KEY_BYTES = 32
_SCOPE_SUFFIX = b"|pages.v1"
_TAG_PAGE = b"\x20"
_NO_TOKENS = Ids.tokens([])


def page_keys(inst: InstanceState, raw: bytes, cache_salt: str) -> list[ChunkKey]:
    """The chunk keys of ``raw`` (``PAGE_KEY_BYTES`` per page), scoped as the module says."""
    if len(raw) % PAGE_KEY_BYTES:
        raise ChunkMismatchError(f"page keys are {PAGE_KEY_BYTES} bytes each; got {len(raw)} bytes")
    root = root_key_bytes(inst.model_name, cache_salt, inst.scope + _SCOPE_SUFFIX) + _TAG_PAGE
    blake2b = hashlib.blake2b
    return [
        int.from_bytes(
            blake2b(root + raw[i : i + PAGE_KEY_BYTES], digest_size=KEY_BYTES, person=PERSON).digest(),
            "little",
        )
        for i in range(0, len(raw), PAGE_KEY_BYTES)
    ]


def exists(
    parts: EngineParts, inst: InstanceState, keys: list[ChunkKey], request_id: str = ""
) -> tuple[int, int]:
    """(leading pages held, how many of them are loading from L2): ``lookup.lookup`` on keys."""
    sid = parts.events.session(inst.instance_id, request_id)
    ps = inst.ctx.chunk_size
    num_tokens = len(keys) * ps
    parts.events.publish(EventType.MP_LOOKUP_START, sid, inst.meta(MpLookupStart, num_tokens=num_tokens))
    l1 = l2 = 0
    room_by = Deadline.within(parts.config.lookup_wait_timeout_s)
    while True:  # runs in L1 and runs loaded from L2 may alternate
        l1 += parts.pool.prefix(keys[l1 + l2 :])
        rest = keys[l1 + l2 :]
        loaded = retrieve_path.prefetch(parts, inst, rest, room_by=room_by) if rest else 0
        if not loaded:
            break
        l2 += loaded
    parts.stats.record_lookup(num_tokens, (l1 + l2) * ps)
    meta = inst.meta(
        MpLookupEnd, num_tokens=num_tokens, hit_tokens=(l1 + l2) * ps, l1_hit_tokens=l1 * ps,
        l2_hit_tokens=l2 * ps,
    )  # fmt: skip
    parts.events.publish(EventType.MP_LOOKUP_END, sid, meta)
    return l1 + l2, l2


def _check_ids(inst: InstanceState, keys: list[ChunkKey], block_ids: RawIds) -> Ids:
    if len(block_ids) != len(keys):
        raise ChunkMismatchError(f"{len(keys)} page keys but {len(block_ids)} block ids (one each)")
    return Ids.blocks(block_ids, inst.ctx.num_blocks)


def store_async(
    parts: EngineParts,
    inst: InstanceState,
    keys: list[ChunkKey],
    block_ids: RawIds,
    *,
    request_id: str = "",
    deadline: Deadline | None = None,
) -> Future[StoreResult]:
    """Copy block ``block_ids[i]`` into the cache as page ``keys[i]`` (present ones skipped).
    Never raises: errors are set on the future, as for ``store.store_async``."""
    future: Future[StoreResult] = Future()
    try:
        ids = _check_ids(inst, keys, block_ids)
        sid = parts.events.session(inst.instance_id, request_id)
        req = StoreRequest(instance_id=inst.instance_id, token_ids=_NO_TOKENS, block_ids=ids,
                           request_id=request_id, deadline=deadline)  # fmt: skip
        wait_until = Deadline.within(parts.config.store_wait_timeout_s).earliest(deadline)
        ps = inst.ctx.chunk_size
        op = _StoreOp(parts, inst, req, sid, keys, wait_until, keyed_tokens=len(keys) * ps)
        start = inst.meta(MpStoreStart, num_tokens=len(keys) * ps, num_chunks=len(keys))
        parts.events.publish(EventType.MP_STORE_START, sid, start)
    except Exception as err:  # a bad request: nothing was reserved
        future.set_exception(err)
        return future
    op.future = future
    op.run()
    return future


def retrieve_async(
    parts: EngineParts,
    inst: InstanceState,
    keys: list[ChunkKey],
    block_ids: RawIds,
    *,
    request_id: str = "",
    deadline: Deadline | None = None,
) -> Future[RetrieveResult]:
    """Copy the leading cached pages of ``keys`` into ``block_ids``; the result's
    ``retrieved_tokens`` / page size is how many. Never raises, as ``retrieve.retrieve_async``."""
    future: Future[RetrieveResult] = Future()
    try:
        ids = _check_ids(inst, keys, block_ids)
        sid = parts.events.session(inst.instance_id, request_id)
        wait_until = Deadline.within(parts.config.retrieve_wait_timeout_s).earliest(deadline)
        num_tokens = len(keys) * inst.ctx.chunk_size
        op = _RetrieveOp(parts, inst, sid, num_tokens, 0, 0, keys, ids, deadline, wait_until)
        start = inst.meta(MpRetrieveStart, num_tokens=num_tokens, skip_tokens=0)
        parts.events.publish(EventType.MP_RETRIEVE_START, sid, start)
    except Exception as err:
        future.set_exception(err)
        return future
    op.future = future
    try:
        if op.ready_now():
            op.copy()
        else:
            parts.retrieve_waiter.add(inst.instance_id, op.wait_pass)
    except Exception as err:  # never leave the future unresolved, nor a page pinned
        op.fail(err)
    return future


class EnginePages:
    """The engine's page entry points (``CacheEngine.pages``): keys checked and scoped by the
    instance, then the functions above. A bad instance or key fails the future, never raises."""

    def __init__(self, parts: EngineParts, instance: Callable[[int], InstanceState]) -> None:
        self._parts, self._instance = parts, instance

    def exists(
        self, instance_id: int, keys: bytes, *, cache_salt: str = "", request_id: str = ""
    ) -> tuple[int, int]:
        """Leading pages of ``keys`` (32 bytes each) held, and how many of those are loading
        from L2 (a prefetch, as ``lookup`` starts)."""
        inst, keyed = self._keyed(instance_id, keys, cache_salt)
        return exists(self._parts, inst, keyed, request_id)

    def _keyed(self, instance_id: int, keys: bytes, cache_salt: str) -> tuple[InstanceState, list[ChunkKey]]:
        """The instance and its scoped keys; raises for an unknown instance or malformed keys."""
        inst = self._instance(instance_id)
        return inst, page_keys(inst, keys, cache_salt)

    def store_async(
        self,
        instance_id: int,
        keys: bytes,
        block_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        deadline: Deadline | None = None,
    ) -> Future[StoreResult]:
        """``store_async`` of one page per key, from ``block_ids[i]``."""
        try:
            inst, keyed = self._keyed(instance_id, keys, cache_salt)
        except Exception as err:
            return failed(err)
        return store_async(self._parts, inst, keyed, block_ids, request_id=request_id, deadline=deadline)

    def retrieve_async(
        self,
        instance_id: int,
        keys: bytes,
        block_ids: RawIds,
        *,
        cache_salt: str = "",
        request_id: str = "",
        deadline: Deadline | None = None,
    ) -> Future[RetrieveResult]:
        """``retrieve_async`` of the leading cached pages of ``keys`` into ``block_ids``."""
        try:
            inst, keyed = self._keyed(instance_id, keys, cache_salt)
        except Exception as err:
            return failed(err)
        return retrieve_async(self._parts, inst, keyed, block_ids, request_id=request_id, deadline=deadline)


__all__ = ["PAGE_KEY_BYTES", "EnginePages", "exists", "page_keys", "retrieve_async", "store_async"]
