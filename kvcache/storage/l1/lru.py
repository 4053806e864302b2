"""Least-recently-used eviction: the default ``EvictionPolicy``.

Its own module so that other policies (ARC, LFU) can sit beside it and be picked by name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvcache.records import ChunkKey
from kvcache.storage.l2.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """An ordered dict, oldest first; every operation is O(1). Not thread-safe: the pool locks."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def add(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[ChunkKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def discard(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def victim(self) -> ChunkKey | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


__all__ = ["LRUPolicy"]
