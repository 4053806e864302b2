"""The L1 pool's state under its lock: which key holds which slot, who pins it, and what is
evicted to make room.

Split from ``pool`` so that the rules of the table (a slot is taken from the slabs, else from
extents other geometries left free, else from the victims of the tenant holding the most,
``storage.shares``; pins keep an entry off the policy; the watermark bounds what stays after a
write) read on their own, apart from the operations that wait on it. Every method here but
``on_settled`` and the maintenance ones (``evict``, ``clear``), which take it themselves,
expects the caller to hold ``_lock``; events are collected in a list and published by the
caller after the lock is dropped (``_publish``), and settle watchers are called the same way
(``_call_watchers``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from kvcache.observability.event import (
    Event,
    EventSink,
    EventType,
    L1AllocationFailed,
    L1Cleared,
    L1KeysEvicted,
)
from kvcache.records import ChunkKey
from kvcache.storage.l1.entry import L1Entry
from kvcache.storage.l1.slab import SlabAllocator, SlotShape
from kvcache.storage.l2.base import EvictionPolicy
from kvcache.storage.shares import TenantShares

logger = logging.getLogger("kvcache.storage.l1")

#: What ``on_settled`` calls: the entry, whose ``ok`` says whether it became READY.
Watcher = Callable[[L1Entry], None]


class SlotTable:
    """Keys to slots, pins and eviction, for ``L1Pool`` (which adds the operations)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        watermark: float,
        extent_bytes: int,
        pin_memory: bool,
        policy: Callable[[], EvictionPolicy],
        bus: EventSink,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.watermark = watermark
        self.extent_bytes = extent_bytes
        self.pin_memory = pin_memory
        if isinstance(policy, EvictionPolicy):  # one per tenant: a shared instance would mix them
            raise TypeError("policy must make a fresh EvictionPolicy per call (a class or factory)")
        self._policy = TenantShares(policy)  # one order per tenant; room from the fullest
        self._bus = bus
        self._lock = threading.Lock()
        self._entries: dict[ChunkKey, L1Entry] = {}
        self._slabs = SlabAllocator(capacity_bytes, extent_bytes, self.pin_memory)
        self.used_bytes = 0  # slots holding an entry (any state), in slot strides
        self.allocation_failures = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes of host memory the pool holds (the sum of its extents)."""
        return self._slabs.allocated_bytes

    @property
    def _pinned(self) -> int:
        """Entries holding at least one pin (the shares count them per tenant)."""
        return self._policy.pinned_total()

    def on_settled(self, entries: Iterable[L1Entry], watcher: Watcher) -> None:
        """Call ``watcher(entry)`` once each WRITING/LOADING entry has settled, on the thread
        that settles it (``L1Pool.finish``) after the lock is dropped; at once, here, for one
        settled already. Every unsettled entry is settled once (it is pinned until then, so
        never evicted), so a watcher always runs. It must be quick and must not raise."""
        now: list[L1Entry] = []
        with self._lock:
            for entry in entries:
                if entry._done.is_set():
                    now.append(entry)
                elif entry.watchers is None:
                    entry.watchers = [watcher]
                else:
                    entry.watchers.append(watcher)
        self._call_watchers([(watcher, entry) for entry in now])

    @staticmethod
    def _call_watchers(calls: list[tuple[Watcher, L1Entry]]) -> None:
        for watcher, entry in calls:
            try:
                watcher(entry)
            except Exception:  # one broken watcher must not cost another its call
                logger.exception("L1 settle watcher failed")

    # -- maintenance ----------------------------------------------------------------------
    def evict(self, keys: Iterable[ChunkKey]) -> int:
        """Evict the given READY, unpinned keys (others are left alone); returns how many."""
        events: list[Event] = []
        with self._lock:
            victims = [e for k in keys if (e := self._entries.get(k)) is not None and k in self._policy]
            self._evict(victims, events)
        self._publish(events)
        return len(victims)

    def clear(self) -> int:
        """Drop every READY, unpinned entry and release free extents; publishes L1_CLEARED."""
        with self._lock:
            victims = [e for k, e in self._entries.items() if k in self._policy]
            for entry in victims:
                self._policy.discard(entry.key)
                self._remove(entry)
            self._slabs.release_free_extents()
        self._publish([Event(EventType.L1_CLEARED, L1Cleared(num_keys=len(victims)))])
        return len(victims)

    # -- internals (lock held) ------------------------------------------------------------
    def _pin(self, entry: L1Entry) -> None:
        if entry.pins == 0:
            self._policy.discard(entry.key)
            self._policy.pinned(entry.tenant, 1)
        entry.pins += 1

    def _unpin(self, entry: L1Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            self._policy.pinned(entry.tenant, -1)

    def _allocate(
        self, slot_shape: SlotShape, key: ChunkKey, events: list[Event], tenant: str
    ) -> L1Entry | None:
        evicted: list[L1Entry] = []
        owner: str | None = None  # whose chunks this allocation evicts, once it began
        while (slot := self._slabs.take(slot_shape)) is None:
            # Room must come from elsewhere: wholly free extents of other slabs, then victims
            # (the fullest tenant's: ``storage.shares``).
            if self._slabs.reclaim_for(slot_shape):
                continue
            victim, owner = self._policy.victim_for(tenant, owner)
            if victim is None:
                break
            entry = self._entries[victim]
            self._policy.discard(victim)
            self._remove(entry)
            evicted.append(entry)
        if evicted:
            events.append(self._evicted_event(evicted))
        if slot is None:
            self.allocation_failures += 1
            return None
        entry = L1Entry(key, slot_shape, slot.tensor, slot.extent, slot.offset, tenant)  # born pinned
        self._entries[key] = entry
        self.used_bytes += slot_shape.stride
        self._policy.charge(key, tenant, slot_shape.stride)
        return entry

    def _remove(self, entry: L1Entry) -> None:
        del self._entries[entry.key]
        self._policy.release(entry.key, entry.slot_shape.stride)
        self._slabs.free(entry.slot_shape, entry._extent, entry._offset)
        self.used_bytes -= entry.slot_shape.stride

    def _evict(self, victims: list[L1Entry], events: list[Event]) -> None:
        for entry in victims:
            self._policy.discard(entry.key)
            self._remove(entry)
        if victims:
            events.append(self._evicted_event(victims))

    def _evict_to_watermark(self, events: list[Event], tenant: str | None) -> None:
        """After ``tenant``'s write: down to the watermark, from those it may take room from,
        and never below an equal share of the watermark (another tenant's pinned chunks, its
        writes in flight, may hold L1 above it: they are not the writer's to pay for)."""
        limit = self.watermark * self.capacity_bytes
        victims: list[L1Entry] = []
        while self.used_bytes > limit:
            key, owner = self._policy.victim_for(tenant)
            if key is None or not self._policy.over_share(owner, limit):
                break
            entry = self._entries[key]
            self._policy.discard(key)
            self._remove(entry)
            victims.append(entry)
        if victims:
            events.append(self._evicted_event(victims))

    def _evicted_event(self, victims: list[L1Entry]) -> Event:
        meta = L1KeysEvicted(
            keys=[e.key for e in victims],
            num_bytes=sum(e.nbytes for e in victims),
            used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
        )
        return Event(EventType.L1_KEYS_EVICTED, meta)

    def _alloc_failed_event(self, chunks: int, nbytes: int) -> Event:
        meta = L1AllocationFailed(
            requested_chunks=chunks, num_bytes=nbytes, used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
        )  # fmt: skip
        return Event(EventType.L1_ALLOCATION_FAILED, meta)

    def _publish(self, events: list[Event]) -> None:
        for event in events:
            self._bus.publish(event)


def touch_order(
    key_lists: Sequence[Sequence[ChunkKey]], runs: Sequence[int], shared: Sequence[int] | None
) -> list[ChunkKey]:
    """The keys ``resident`` of each list in turn touches (each list's prefix of ``runs``
    keys, its head last), each once, oldest first: the order that leaves the LRU state those
    touches would. A head a list shares with the next one (``shared``) is touched again by
    that one, later, so only the next one's touch counts."""
    seen: set[ChunkKey] = set()
    newest_first: list[ChunkKey] = []
    later = 0  # leading keys of this list that the next one touched after it
    for i in range(len(key_lists) - 1, -1, -1):
        keys, run = key_lists[i], runs[i]
        for key in keys[later:run]:  # a list touches its prefix tail first: its head is newest
            if key not in seen:
                seen.add(key)
                newest_first.append(key)
        later = min(shared[i], run) if shared is not None and i else 0
    newest_first.reverse()
    return newest_first


__all__ = ["SlotTable", "Watcher", "touch_order"]
