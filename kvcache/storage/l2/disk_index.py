"""The disk tier's index: which chunk files it holds, whose share of the tier each counts
against, and which leave when the tier is over its bound.

Split from ``disk`` (the files, the lock, the events, a full disk) because this is where the
tier decides *whose* file leaves. The tier is one store for every principal of a daemon; under
one eviction order for all, a tenant that stores more than the tier holds evicted every other
tenant's chunks, and their disk hits turned into recomputes. So it follows the rule L1 does,
written once in ``storage.shares``: each tenant's files keep their own order under the
configured policy (``--l2-disk-eviction``), and a file leaves for room only from the tenant
holding the most bytes of the tier, never from one holding less than the writer (the writer
first among equals). A tenant within an equal share keeps every file however much another
writes; a tenant alone may fill the whole tier; with one tenant it is the configured policy,
call for call.

A file counts against the tenant that wrote it (a store's write-through, or a promotion on a
hit, on behalf of the chunk's owner in L1) until it leaves: a later write of the same key, by
anyone, changes no owner, and a read by another tenant orders it within its owner's policy.
A file is whole and evictable the moment it is indexed, so nothing here is ever pinned. Not
thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.records import ChunkKey
from kvcache.storage.l2.base import EvictionPolicy
from kvcache.storage.shares import TenantShares


class DiskIndex:
    """Key -> (file bytes, payload CRC32) of the files the tier holds, with their owners."""

    def __init__(self, make_policy: Callable[[], EvictionPolicy]) -> None:
        if isinstance(make_policy, EvictionPolicy):  # one per tenant: a shared instance would mix them
            raise TypeError("policy must make a fresh EvictionPolicy per call (a class or factory)")
        self._files: dict[ChunkKey, tuple[int, int]] = {}
        self._shares = TenantShares(make_policy)
        self.used_bytes = 0

    def get(self, key: ChunkKey) -> tuple[int, int] | None:
        return self._files.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def keys(self) -> list[ChunkKey]:
        return list(self._files)

    def add(self, key: ChunkKey, size: int, crc: int, tenant: str) -> None:
        """A file of ``size`` bytes now holds ``key`` (not indexed yet), for ``tenant``."""
        self._shares.charge(key, tenant, size, pinned=False)
        self._shares.add(key)
        self._files[key] = (size, crc)
        self.used_bytes += size

    def pop(self, key: ChunkKey) -> tuple[int, int] | None:
        """Forget ``key``'s file (evicted, deleted, found damaged): its (size, crc), if held."""
        there = self._files.pop(key, None)
        if there is not None:
            self._shares.discard(key)
            self._shares.release(key, there[0])
            self.used_bytes -= there[0]
        return there

    def touch(self, key: ChunkKey) -> None:
        """``key`` was read or written again: ordered within its owner's policy."""
        self._shares.touch(key)

    def victim_for(self, tenant: str, adding: int) -> ChunkKey | None:
        """The file a write of ``adding`` bytes by ``tenant`` would evict first."""
        return self._shares.victim_for(tenant, adding=adding)[0]

    def evict_to(self, limit: int, tenant: str | None) -> list[tuple[ChunkKey, int, int]]:
        """Forget files until at most ``limit`` bytes are held, each the next victim on
        ``tenant``'s behalf (None: no writer, as at start, the fullest tenant's); their
        (key, size, crc), for the caller to remove."""
        evicted: list[tuple[ChunkKey, int, int]] = []
        while self.used_bytes > limit:
            key = self._shares.victim_for(tenant)[0]
            if key is None:  # nothing held: a file on disk is always evictable
                break
            size, crc = self._files[key]
            self.pop(key)
            evicted.append((key, size, crc))
        return evicted

    def held(self) -> dict[str, int]:
        """Bytes of the tier each tenant holding any is charged for."""
        return self._shares.held()


__all__ = ["DiskIndex"]
