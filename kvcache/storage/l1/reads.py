"""L1's readers: which leading keys of a prompt are resident, and pins on them.

Split from ``pool`` by responsibility: these never reserve a slot, wait or evict; they look
keys up under the lock, order the policy (a lookup's touch) and take pins that keep entries
off it (a retrieve's prefix, a lookup's while it loads the rest: ``acquire``,
``pin_resident``). Dropping a pin wakes writers waiting for room, so ``release`` stays with
the waits in ``pool``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcache.records import ChunkKey
from kvcache.storage.l1.entry import EntryState, L1Entry
from kvcache.storage.l1.table import SlotTable, touch_order


class ResidentReads(SlotTable):
    """Finding and pinning resident entries (READY or LOADING), for ``L1Pool``."""

    def prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are resident (READY or LOADING); touches them for LRU."""
        return self.resident(keys)[0]

    def resident(self, keys: Sequence[ChunkKey]) -> tuple[int, int]:
        """``prefix``, and how many of those leading keys are still LOADING from L2 (a load
        another request began: a lookup joins it instead of reading the chunk again)."""
        return self.resident_many((keys,))[0]

    def resident_many(
        self, key_lists: Sequence[Sequence[ChunkKey]], shared: Sequence[int] | None = None
    ) -> list[tuple[int, int]]:
        """``resident`` of each list, under one hold of the lock (a scheduler step's lookups).

        ``shared[i]``: how many leading keys list ``i`` has in common with list ``i - 1`` (a
        step's prompts that share a system prompt): that head is walked once. The LRU order
        left is the one ``resident`` of each list in turn would leave, but each key is
        touched once."""
        out: list[tuple[int, int]] = []
        entries = self._entries
        writing, loading_state = EntryState.WRITING, EntryState.LOADING
        with self._lock:
            n = loading = 0
            for i, keys in enumerate(key_lists):
                start = shared[i] if shared is not None and i else 0
                if start and n < start:  # the head both share ends the previous prefix too
                    out.append((n, loading))
                    continue
                if not start or (n > start and loading):  # rare: count the head's loads again
                    loading = sum(entries[key].state is loading_state for key in keys[:start])
                n = start
                for key in keys[start:] if start else keys:
                    entry = entries.get(key)
                    if entry is None or entry.state is writing:
                        break
                    n += 1
                    if entry.state is loading_state:
                        loading += 1
                out.append((n, loading))
            self._policy.touch_many(touch_order(key_lists, [run for run, _ in out], shared))
        return out

    def acquire(self, keys: Sequence[ChunkKey]) -> list[L1Entry]:
        """Pin the leading resident (READY or LOADING) entries of ``keys``."""
        out: list[L1Entry] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.state is EntryState.WRITING:
                    break
                self._pin(entry)
                out.append(entry)
        return out

    def pin_resident(self, keys: Sequence[ChunkKey]) -> list[L1Entry | None]:
        """Pin every resident (READY or LOADING) entry of ``keys``, not only the leading run:
        aligned with ``keys``, None where a key is absent or being written. A lookup holds
        them while it loads the gaps between them, so its loads evict none of them."""
        out: list[L1Entry | None] = []
        entries, writing = self._entries, EntryState.WRITING
        with self._lock:
            for key in keys:
                entry = entries.get(key)
                if entry is None or entry.state is writing:
                    out.append(None)
                    continue
                self._pin(entry)
                out.append(entry)
        return out

    def pin(self, entries: Iterable[L1Entry]) -> None:
        with self._lock:
            for entry in entries:
                self._pin(entry)

    def get(self, key: ChunkKey) -> L1Entry | None:
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.state is EntryState.READY

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["ResidentReads"]
