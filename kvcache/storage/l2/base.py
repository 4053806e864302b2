"""The storage contracts: ``L2Adapter`` (a slower tier) and ``EvictionPolicy`` (who leaves L1).

Kept apart from the implementations so a reader learns the whole life of a chunk here, and so
adding a tier or a policy means adding a file next to this one plus a line in ``factory.py``.

Life of a chunk, in call order:

1. ``L1Pool.begin_write`` reserves pinned slots; the engine copies engine blocks into them.
2. ``L1Pool.finish_write`` makes them visible and tells the ``EvictionPolicy`` (``add``).
3. ``L2Adapter.store`` runs on an I/O thread (write-through) while the L1 slot stays pinned,
   for each tier whose admission policy takes the chunk (``kvcache.storage.admission``; a
   chunk declined then may be written when an L1 read makes it worth it).
4. A lookup that misses L1 asks ``L2Adapter.contains``; a hit is prefetched with
   ``L2Adapter.load`` straight into a fresh L1 slot (``L1Pool.begin_load``/``finish_load``).
5. ``L1Pool`` evicts ``EvictionPolicy.victim()`` when it needs room; the L2 copy stays.

Adapters are synchronous and thread-safe; ``kvcache.storage.l2.async_front.AsyncL2`` adds the thread
pool, the in-flight bound, the failure back-off and the events, once for every tier. It hands
queued work over in batches (``store_many``/``load_many``, at most ``max_batch`` chunks): a
remote tier sends a batch in one pipelined round trip per server, a local one just loops.
Batch results are per item, so a tier made of shards (Redis Cluster) can fail the items of a
dead shard and serve the rest; such failures are tagged ``scope="shard"`` and do not make
``AsyncL2`` skip the whole tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvcache.errors import CorruptChunkError, ForgedRecordError, StorageError
from kvcache.records import ChunkKey

#: Called by ``L2Adapter.store`` with the bytes written, at the moment the chunk is visible.
Announce = Callable[[int], None]

#: Failure reasons carried by ``StorageError.reason`` and published in ``L2_*_FAILED`` events.
REASONS = ("corrupt", "forged", "timeout", "unavailable", "io", "full", "busy")
#: How much of a tier a failure speaks for (``StorageError.scope``): the whole tier, or one
#: shard of it (the other shards still answer, so the tier must not be skipped as a whole).
SCOPES = ("tier", "shard")

#: ``store_many`` items: the key, the chunk, and the announce callback of ``store``.
StoreItem = tuple[ChunkKey, torch.Tensor, Announce | None]
#: ``load_many`` items: the key and the tensor to fill.
LoadItem = tuple[ChunkKey, torch.Tensor]


class L2Adapter(ABC):
    """One L2 tier. Every method may be called from several threads at once.

    Errors: a tier that cannot be reached raises ``StorageError`` (``ConnectionError``-like
    causes are tagged ``reason="unavailable"``/``"timeout"`` by ``async_front``); a stored chunk that
    fails validation raises ``CorruptChunkError`` after deleting it. A plain miss is not an error.
    """

    #: Short name used in events and metrics (``"disk"``, ``"redis"``, ``"redis-cluster"``).
    backend: str = "l2"
    #: Most chunks ``AsyncL2`` hands to one ``store_many``/``load_many`` call (1: no batching).
    max_batch: int = 1
    #: Most bytes of chunks in one batch (a batch always holds at least one chunk).
    max_batch_bytes: int = 64 << 20
    #: Whether ``store_many_with_meta`` keeps each chunk's meta with it. The disk tier does
    #: (it survives a restart of the daemon), and so do the Redis tiers (``load_many_with_meta``
    #: hands it to the other daemons that load the chunk).
    keeps_meta: bool = False

    @abstractmethod
    def store(self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        """Persist ``chunk`` (a contiguous CPU tensor) under ``key``; return bytes written.

        ``announce(nbytes)`` must be called once the chunk is visible in the tier, inside
        whatever keeps the tier's own view consistent (the disk tier's index lock): that is
        where ``AsyncL2`` publishes ``L2_STORE_FINISHED``, so the event can never be ordered
        after the eviction of the same key by another thread.
        """

    @abstractmethod
    def load(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Fill ``out`` with the chunk stored under ``key``; False on a miss.

        The stored header must match ``out`` (shape, dtype, bytes) and the checksum must
        verify, else the entry is deleted and ``CorruptChunkError`` raised; ``out`` is then
        unspecified and the caller must not use it.
        """

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key (one round trip for remote tiers)."""

    @abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove the keys that exist; return how many were removed."""

    # -- batches: per-item outcomes. The defaults loop; remote tiers pipeline. ------------
    def store_many(self, items: Sequence[StoreItem]) -> list[int | Exception]:
        """``store`` each item; per item the bytes written or the exception it failed with.

        One item's failure must not stop the others. ``announce`` is called per stored item,
        as ``store`` promises.
        """
        out: list[int | Exception] = []
        for key, chunk, announce in items:
            try:
                out.append(self.store(key, chunk, announce))
            except Exception as exc:
                out.append(exc)
        return out

    def store_many_with_meta(
        self, items: Sequence[StoreItem], metas: Sequence[bytes], tenants: Sequence[str] = ()
    ) -> list[int | Exception]:
        """``store_many``, keeping each item's ``meta`` (its encoded ``ChunkIdentity``) with
        the chunk where the tier can (``keeps_meta``), so a restarted tier reports it in
        ``L2_KEYS_FOUND`` and KV events announce the chunk as before. The default drops it.

        ``tenants`` (aligned with ``items``; empty: every item the default tenant ""): on
        whose behalf each chunk is written. A tier that shares itself out between tenants
        (the disk tier, ``storage.shares``) charges each chunk to its writer and makes room
        on its behalf; the others ignore it (Redis evicts by itself)."""
        return self.store_many(items)

    def load_many(self, items: Sequence[LoadItem]) -> list[bool | Exception]:
        """``load`` each item; per item hit/miss or the exception it failed with."""
        out: list[bool | Exception] = []
        for key, tensor in items:
            try:
                out.append(self.load(key, tensor))
            except Exception as exc:
                out.append(exc)
        return out

    def load_many_with_meta(self, items: Sequence[LoadItem]) -> tuple[list[bool | Exception], list[bytes]]:
        """``load_many``, and per item the meta its writer kept with the chunk (``b""`` for a
        miss, a failure, or a chunk written without one), so a daemon loading a chunk from a
        tier it shares learns how the writer announced it. The default keeps none."""
        return self.load_many(items), [b""] * len(items)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool | Exception]:
        """``contains``, per key; a failure of the one round trip fails every key."""
        try:
            return list(self.contains(keys))
        except Exception as exc:
            return [exc] * len(keys)

    def victim_for(self, nbytes: int, tenant: str = "") -> ChunkKey | None:
        """The chunk this tier would evict to make room for ``nbytes`` more written on
        ``tenant``'s behalf (what an admission policy weighs a candidate against: in a tier
        shared out between tenants, a chunk of the fullest one it may take from), or None
        when there is room or the tier cannot say (Redis evicts by itself). Must be cheap: it
        is asked once per stored chunk."""
        return None

    def info(self) -> dict[str, Any]:
        """JSON-able description for ``CacheEngine.status()``."""
        return {"backend": self.backend}

    def close(self) -> None:  # noqa: B027 - optional hook, most adapters hold nothing to close
        """Release files, sockets; idempotent."""


class EvictionPolicy(ABC):
    """Orders the *evictable* L1 keys (ready and unpinned); the pool asks it for a victim.

    The pool removes a key while it is pinned and adds it back when the last pin goes, so a
    policy never has to know about pins and ``victim`` is O(1) for LRU.
    """

    @abstractmethod
    def add(self, key: ChunkKey) -> None:
        """``key`` became evictable (just written, or just unpinned after use)."""

    @abstractmethod
    def touch(self, key: ChunkKey) -> None:
        """``key`` was used (a lookup hit); no-op when it is not tracked."""

    def touch_many(self, keys: Iterable[ChunkKey]) -> None:
        """``touch`` each key in order (a scheduler step's lookups, under one hold of the
        pool's lock); a policy may do it in one pass."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def discard(self, key: ChunkKey) -> None:
        """Stop tracking ``key`` (pinned, evicted or deleted); no-op when absent."""

    @abstractmethod
    def victim(self) -> ChunkKey | None:
        """The key to evict next, without removing it; None when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


def storage_error(message: str, reason: str, scope: str = "tier") -> StorageError:
    """A ``StorageError`` tagged with one of ``REASONS`` and ``SCOPES`` (read back by
    ``failure_reason`` and ``failure_scope``)."""
    err = StorageError(message)
    err.reason = reason  # type: ignore[attr-defined]
    err.scope = scope  # type: ignore[attr-defined]
    return err


def failure_reason(exc: BaseException) -> str:
    """The ``REASONS`` entry for an adapter failure (``"io"`` when untagged)."""
    if isinstance(exc, ForgedRecordError):  # a corrupt record, but maybe an attack: told apart
        return "forged"
    if isinstance(exc, CorruptChunkError):
        return "corrupt"
    reason = getattr(exc, "reason", None)
    return reason if isinstance(reason, str) else "io"


def failure_scope(exc: BaseException) -> str:
    """The ``SCOPES`` entry for an adapter failure (``"tier"`` when untagged)."""
    return "shard" if getattr(exc, "scope", None) == "shard" else "tier"


__all__ = [
    "REASONS",
    "SCOPES",
    "EvictionPolicy",
    "L2Adapter",
    "LoadItem",
    "StoreItem",
    "failure_reason",
    "failure_scope",
    "storage_error",
]
