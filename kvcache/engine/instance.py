"""One registered engine instance as the CacheEngine sees it: context, chunk geometry, keys.

Split from the engine so that key scoping lives in one small place: the chunk geometry (KV
count, layers, tokens, width, dtype) is folded into every key, so two instances share chunks
exactly when they could exchange the bytes (the same model in any of the six layouts), and never
when they could not (another dtype, or a tensor-parallel rank with other heads but — careful —
the same shape: give each rank its own ``model_name`` or ``cache_salt``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvcache.context import CacheContext
from kvcache.engine.completion import Completer
from kvcache.errors import ChunkMismatchError
from kvcache.ids import RawIds
from kvcache.keys import ChunkHasher, KeyScope
from kvcache.observability.event import OperationMeta
from kvcache.records import ChunkKey, dtype_name
from kvcache.request import Request
from kvcache.storage.l1.slab import SlotShape

OpMetaT = TypeVar("OpMetaT", bound=OperationMeta)

_MAX_HASHERS = 4096  # distinct key scopes remembered per instance
_CACHED_SCOPE_CHARS = 1024
"""A scope longer than this (say, the key extra of a request with many images, seen once) is
hashed afresh each time instead of remembered: the cache holds at most 4 MiB of client
strings per instance."""
_NO_SCOPE = KeyScope()


class InstanceState:
    """The engine's state of one registered instance: its context, key hashers and completer
    (which finishes its copy jobs, one thread, in order). The daemon's record of the
    registration itself (token, principal, mapped tensors) is ``server.registry.RegistrationRecord``."""

    __slots__ = (
        "_hashers",
        "_lock",
        "_watches",
        "completer",
        "ctx",
        "device",
        "instance_id",
        "leaving",
        "model_name",
        "scope",
        "slot_shape",
        "tenant",
    )

    def __init__(self, instance_id: int, model_name: str, ctx: CacheContext, tenant: str = "") -> None:
        self.instance_id = instance_id
        self.model_name = model_name
        self.tenant = tenant  # whose share of L1 and disk its chunks count against (``storage.shares``)
        self.ctx = ctx
        self.completer = Completer(ctx.transfer, f"kvcache-complete-{instance_id}")
        self.device = str(ctx.device)
        self.slot_shape = SlotShape(tuple(ctx.chunk_shape()), ctx.dtype)
        self.scope = (
            "chunk:" + "x".join(map(str, self.slot_shape.shape)) + ":" + dtype_name(ctx.dtype)
        ).encode()
        self._hashers: dict[KeyScope, ChunkHasher] = {}
        self._lock = threading.Lock()
        # Set once ``unregister`` (or the engine's ``close``) begins (``leave``): a store path
        # that would submit a copy later, from a callback, submits none (the blocks may be
        # unmapped), and the stores watching L2 loads stop watching (``watch``).
        self.leaving = False
        self._watches: set[Callable[[], None]] = set()

    def watch(self, stop: Callable[[], None]) -> bool:
        """Note a store's end of its watch of L2 loads (``store._StoreOp._watch``), for
        ``leave`` to call; False, nothing noted, once the instance is leaving."""
        with self._lock:
            if self.leaving:
                return False
            self._watches.add(stop)
            return True

    def unwatch(self, stop: Callable[[], None]) -> None:
        with self._lock:
            self._watches.discard(stop)

    def leave(self) -> None:
        """The instance is leaving: no store copies from its blocks any more, and the stores
        watching loads stop now (their futures resolve before ``unregister`` returns)."""
        with self._lock:
            self.leaving = True
            stops, self._watches = self._watches, set()
        for stop in stops:
            stop()

    def request_keys(self, req: Request) -> list[ChunkKey]:
        """The chunk keys of a request; ``ChunkMismatchError`` for one built for another
        geometry (its block ids must be exactly the blocks of its full chunks here: a count,
        as ``request`` checked the ids themselves)."""
        keys = self.keys(req.token_ids.values, req.scope)
        want = len(keys) * self.ctx.blocks_per_chunk
        if len(req.block_ids) != want:
            raise ChunkMismatchError(
                f"the request holds {len(req.block_ids)} block ids for {len(keys)} full chunks "
                f"({want} expected): it was built for another instance's geometry"
            )
        return keys

    def keys(self, token_ids: RawIds, key_scope: KeyScope = _NO_SCOPE) -> list[ChunkKey]:
        """The chunk keys of ``token_ids`` under ``key_scope`` (with this instance's model and
        geometry ``scope``)."""
        return self.hasher(key_scope).keys(token_ids)

    def hasher(self, key_scope: KeyScope = _NO_SCOPE) -> ChunkHasher:
        """The key hasher of ``key_scope`` (kept per scope: a digest each to build)."""
        hasher = self._hashers.get(key_scope)
        if hasher is None:
            salt = key_scope.salt_field()
            hasher = ChunkHasher(self.model_name, self.ctx.chunk_size, cache_salt=salt, scope=self.scope)
            if len(salt) > _CACHED_SCOPE_CHARS:  # kept, it would keep the client's string
                return hasher
            with self._lock:
                if len(self._hashers) >= _MAX_HASHERS:
                    self._hashers.clear()
                self._hashers[key_scope] = hasher
        return hasher

    def meta(self, cls: type[OpMetaT], **fields: Any) -> OpMetaT:
        """An MP_* event's metadata for this instance: ``fields`` plus what every operation
        event carries (EVENTS.md)."""
        return cls(instance_id=self.instance_id, model_name=self.model_name, device=self.device, **fields)

    def info(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "format": ctx.format.name,
            "device": self.device,
            "dtype": dtype_name(ctx.dtype),
            "num_layers": ctx.num_layers,
            "num_blocks": ctx.num_blocks,
            "block_size": ctx.block_size,
            "chunk_bytes": ctx.chunk_nbytes(),
        }
