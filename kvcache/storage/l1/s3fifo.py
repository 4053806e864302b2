"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP '23).

Why beside LRU: under LRU a burst of chunks used once (decode chunks, one-off prompts) pushes
out a shared prefix that is used every few seconds but not in the last burst. S3-FIFO keeps
new keys in a *small* FIFO (about a tenth of the keys); one that leaves it without having been
used again is evicted at once (quick demotion) and remembered in a *ghost* FIFO of keys only;
one used again moves to the *main* FIFO, where a key is evicted only after its use counter
(0..3) has run down by one per pass. A key added while in the ghost goes straight to main.

Fitted to the ``EvictionPolicy`` contract, where the pool *discards* a key while it is pinned
and *adds* it back when the last pin goes: every discard (pin, eviction, delete) remembers the
key in the ghost, so a chunk pinned by a read comes back to the main queue (a read is a use),
and a victim discarded from the small queue is the paper's demotion to the ghost. ``victim``
performs the paper's queue moves lazily (small-queue keys used again go to main; main-queue
keys with uses left go round again) until the head it returns has none; it removes nothing, so
asking twice without a discard gives the same key. Every operation is amortised O(1). Not
thread-safe: the pool, and the disk tier, call it under their lock.
"""

from __future__ import annotations

from collections import OrderedDict

from kvcache.records import ChunkKey
from kvcache.storage.l2.base import EvictionPolicy

_MAX_FREQ = 3
_SMALL_SHARE = 0.1
_MIN_GHOST = 64


class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO, main FIFO, ghost FIFO (keys only, bounded by the keys tracked)."""

    def __init__(self) -> None:
        self._small: OrderedDict[ChunkKey, None] = OrderedDict()
        self._main: OrderedDict[ChunkKey, None] = OrderedDict()
        self._ghost: OrderedDict[ChunkKey, None] = OrderedDict()
        self._freq: dict[ChunkKey, int] = {}

    def add(self, key: ChunkKey) -> None:
        if key in self._freq:  # tracked already: a use
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:  # evicted (or pinned) recently: it is worth the main queue
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: ChunkKey) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < _MAX_FREQ:
            self._freq[key] = freq + 1

    def discard(self, key: ChunkKey) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]
        ghost = self._ghost
        ghost[key] = None
        ghost.move_to_end(key)
        bound = max(_MIN_GHOST, len(self._freq))
        while len(ghost) > bound:
            ghost.popitem(last=False)

    def victim(self) -> ChunkKey | None:
        small, main, freq = self._small, self._main, self._freq
        while small or main:
            if small and (not main or len(small) > _SMALL_SHARE * (len(small) + len(main))):
                key = next(iter(small))
                if not freq[key]:
                    return key
                del small[key]  # used while in the small queue: promoted, uses reset
                main[key] = None
                freq[key] = 0
            else:
                key = next(iter(main))
                if not freq[key]:
                    return key
                freq[key] -= 1  # one more pass
                main.move_to_end(key)
        return None

    def queues(self) -> tuple[list[ChunkKey], list[ChunkKey], list[ChunkKey]]:
        """Small, main and ghost keys, oldest first (for tests and ``status``)."""
        return list(self._small), list(self._main), list(self._ghost)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


__all__ = ["S3FIFOPolicy"]
