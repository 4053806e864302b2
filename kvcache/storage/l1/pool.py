"""L1: the CPU chunk pool (pinned when CUDA is present): which key holds which slot, and eviction.

Separate from the engine because it is pure bookkeeping over one lock: which key lives in which
slot, who is using it, and what leaves when room is needed. The engine copies bytes into and out
of the slot tensors (views into the pool, handed to ``CacheContext`` as-is) without the lock.
Slots come from the ``SlabAllocator`` (``slab``: one slab per slot shape, grown by extents);
when it is full, extents left wholly free by another slot shape are released first, then the LRU
victims (of any slot shape) evicted.

Eviction is the policy's (``--l1-eviction``: LRU, or S3-FIFO), with one twist for prefixes: the
chunks of one operation are marked used tail first, so under LRU the head of a prompt is the
most recent and the tail leaves first (a prefix that lost its first chunk lost everything).

Entries (``entry``) are WRITING, LOADING or READY; a pinned or unfinished entry is never
evicted: the policy only ever holds READY, unpinned keys. This module holds the operations
and their waiting rules; the table they share under the lock (keys, slots, pins, eviction and
its events) is ``table.SlotTable``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import torch

from kvcache.observability.event import (
    Event,
    EventSink,
    EventType,
    L1ReadFinished,
    L1WriteFinished,
    NullEventBus,
)
from kvcache.records import ChunkKey
from kvcache.storage.l1.entry import EntryState, L1Entry, WriteReservation
from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.slab import SLOT_ALIGN, SlotShape
from kvcache.storage.l1.table import SlotTable, Watcher, touch_order
from kvcache.storage.l2.base import EvictionPolicy

_NO_FACTS = L1WriteFinished(keys=[], num_bytes=0, used_bytes=0, capacity_bytes=0)
"""The ``L1_WRITE_FINISHED`` template of a write that carries no store facts (a prefetch)."""


class L1Pool(SlotTable):
    """Thread-safe chunk pool. All methods hold the lock only for bookkeeping, never for a copy.

    The operations callers use: reserve slots to write or load (waiting, when allowed, for
    others' pins to go), settle them, find and pin resident prefixes, evict. The table they
    act on (keys, slots, pins, eviction) is ``SlotTable``'s."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        watermark: float = 0.9,
        extent_bytes: int = 64 << 20,
        pin_memory: bool | None = None,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
        bus: EventSink | None = None,
    ) -> None:
        super().__init__(
            capacity_bytes,
            watermark=watermark,
            extent_bytes=extent_bytes,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            policy=policy,
            bus=bus if bus is not None else NullEventBus(),
        )
        self._room = threading.Condition(self._lock)  # notified whenever a pin or slot goes
        self._waiting_writers = 0
        self._waiting_loaders = 0
        self._read_watcher: Callable[[list[L1Entry]], None] | None = None

    # -- reservations ---------------------------------------------------------------------
    def begin_write(
        self,
        slot_shape: SlotShape,
        keys: Sequence[ChunkKey],
        *,
        wait_s: float = 0.0,
        partial: bool = False,
        defer: bool = False,
        held: int = 0,
        stop: threading.Event | None = None,
        tenant: str = "",
    ) -> WriteReservation:
        """Reserve pinned WRITING slots for the absent keys, in order, until memory runs out.

        When memory is held by pinned chunks of other operations (write-through to L2 in
        flight, retrieves copying), wait up to ``wait_s`` for them to let go before giving up:
        a store under pressure is slowed down, not silently dropped. Chunks this reservation
        pinned itself never count as "will be released", so a store larger than L1 does not
        wait for itself.

        With ``partial`` (the caller writes its chunks through to L2, which releases them), a
        reservation that already holds fresh slots stops at the first allocation failure
        instead of waiting (``settled`` < ``len(keys)``): the caller copies and writes those
        through, then asks again for the rest. NOTE: waiting while holding part of a
        reservation lets concurrent stores wait on each other's reservations until the bound
        runs out, all of them together.

        ``defer`` is for a caller that must not wait (``store_async``'s): a key that could get
        a slot only by waiting ends the reservation there (``settled``), nothing failed and
        nothing published; the caller asks again elsewhere, passing what it kept as ``held``
        (fresh slots of an earlier call, still pinned: never waited for, like this call's).
        ``stop``, set by another thread that then calls ``wake_writers``, ends a wait at once.
        ``tenant``: whose share of L1 the fresh slots count against (``storage.shares``); room
        for them is taken from the tenant holding the most.
        """
        new: list[tuple[int, L1Entry]] = []
        present: list[int] = []
        loading: list[tuple[int, L1Entry]] = []
        events: list[Event] = []
        failed = 0
        settled = len(keys)
        deadline = time.monotonic() + wait_s
        loading_state, entries = EntryState.LOADING, self._entries
        with self._lock:
            for i, key in enumerate(keys):
                if (there := entries.get(key)) is not None:
                    present.append(i)
                    if there.state is loading_state:
                        loading.append((i, there))
                    continue
                entry = self._allocate(slot_shape, key, events, tenant)
                mine = len(new) + held
                if entry is None and (
                    (partial and new) or (defer and self._policy.room_may_come(tenant, mine))
                ):
                    settled = i
                    break
                # Pins of tenants it may take room from, other than its own: wait for them.
                while entry is None and self._policy.room_may_come(tenant, mine):
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop.is_set()):
                        break
                    self._waiting_writers += 1
                    try:
                        self._room.wait(left)
                    finally:
                        self._waiting_writers -= 1
                    if key in self._entries:  # written by someone else meanwhile
                        break
                    entry = self._allocate(slot_shape, key, events, tenant)
                if entry is None and (there := entries.get(key)) is not None:
                    present.append(i)
                    if there.state is loading_state:
                        loading.append((i, there))
                    continue
                if entry is None:
                    failed = len(keys) - i
                    events.append(self._alloc_failed_event(failed, failed * slot_shape.nbytes))
                    break
                new.append((i, entry))
        self._publish(events)
        return WriteReservation(new, present, failed, settled, loading)

    def watch_reads(self, watcher: Callable[[list[L1Entry]], None] | None) -> None:
        """Call ``watcher(entries)`` on each retrieve's read (``release`` with ``read_bytes``),
        entries still pinned: L2 admission on a hit (``kvcache.engine.admission``)."""
        self._read_watcher = watcher

    def wake_writers(self) -> None:
        """Wake every ``begin_write`` waiting for room, so one whose ``stop`` is set sees it."""
        with self._lock:
            self._room.notify_all()

    def begin_load(
        self,
        slot_shape: SlotShape,
        keys: Sequence[ChunkKey],
        *,
        wait_s: float = 0.0,
        tenant: str = "",
        held: Iterable[L1Entry] = (),
    ) -> list[L1Entry]:
        """Reserve pinned LOADING slots for ``keys`` (all absent from L1); stops at the first
        key that is present or cannot get memory, so the result is a prefix of ``keys``.

        When no slot is free and no slot of this call is held, it waits up to ``wait_s`` for
        others' pins to go (loads and writes in flight finish within milliseconds). It never
        waits holding slots of its own, so concurrent loaders cannot wait on one another;
        the caller asks again for the rest. ``tenant`` as for ``begin_write``. ``held``: the
        entries the caller pins (a retrieve's prefix so far, its loads included): they stay
        pinned while it waits, so they are never waited for; where only they could give room
        (the caller's share holds nothing else evictable) it stops at once, and the caller's
        prefix ends there. Its own unpinned chunks are evicted for room as any victim."""
        out: list[L1Entry] = []
        events: list[Event] = []
        deadline = time.monotonic() + wait_s
        with self._lock:
            mine = Counter(e.tenant for e in set(held))  # the caller's pins, by owner
            for i, key in enumerate(keys):
                if key in self._entries:
                    break
                entry = self._allocate(slot_shape, key, events, tenant)
                while entry is None and not out and self._policy.room_may_come(tenant, mine):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._waiting_loaders += 1
                    try:
                        self._room.wait(left)
                    finally:
                        self._waiting_loaders -= 1
                    if key in self._entries:  # loaded or written by someone else meanwhile
                        break
                    entry = self._allocate(slot_shape, key, events, tenant)
                if entry is None:
                    if key not in self._entries:
                        n = len(keys) - i
                        events.append(self._alloc_failed_event(n, n * slot_shape.nbytes))
                    break
                entry.state = EntryState.LOADING
                entry.from_l2 = entry.in_l2 = True
                out.append(entry)
        self._publish(events)
        return out

    def finish(
        self,
        entries: Iterable[L1Entry],
        ok: bool | Sequence[bool] = True,
        extra: L1WriteFinished | None = None,
    ) -> None:
        """Settle WRITING/LOADING entries (READY, or dropped when not ok) and drop the writer's pin.

        Publishes ``L1_WRITE_FINISHED`` for the entries that became READY, then evicts down to
        the watermark. ``extra`` (the store's facts about the chunks, ``chunk_write_metadata``,
        aligned with ``entries``) is the template of that event's metadata, used only when
        every entry succeeded, so it always lines up with ``keys``.
        """
        entries = list(entries)
        oks = [ok] * len(entries) if isinstance(ok, bool) else list(ok)
        events: list[Event] = []
        written: list[ChunkKey] = []
        watchers: list[tuple[Watcher, L1Entry]] = []
        nbytes = 0
        with self._lock:
            # Reversed: the head of a prefix becomes the most recent, so the tail leaves first.
            for entry, good in reversed(list(zip(entries, oks, strict=True))):
                self._unpin(entry)
                if good:
                    entry.state = EntryState.READY
                    written.append(entry.key)
                    nbytes += entry.nbytes
                    if entry.pins == 0:
                        self._policy.add(entry.key)
                else:
                    entry.ok = False
                    self._remove(entry)
                entry._done.set()
                if entry.watchers is not None:
                    watchers += [(w, entry) for w in entry.watchers]
                    entry.watchers = None
            self._room.notify_all()
            if written:
                written.reverse()
                base = extra if extra is not None and len(written) == len(entries) else _NO_FACTS
                meta = msgspec.structs.replace(
                    base, keys=written, num_bytes=nbytes, used_bytes=self.used_bytes,
                    capacity_bytes=self.capacity_bytes,
                )  # fmt: skip
                events.append(Event(EventType.L1_WRITE_FINISHED, meta))
            # On the writer's behalf (even if nothing was written): room from those it may take it from.
            self._evict_to_watermark(events, entries[0].tenant if entries else None)
        self._publish(events)
        self._call_watchers(watchers)

    # -- readers --------------------------------------------------------------------------
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

    def pin(self, entries: Iterable[L1Entry]) -> None:
        with self._lock:
            for entry in entries:
                self._pin(entry)

    def release(self, entries: Iterable[L1Entry], *, read_bytes: int | None = None) -> None:
        """Drop one pin per entry; with ``read_bytes`` (a retrieve read them) hand them to the
        read watcher first, while still pinned, then publish ``L1_READ_FINISHED`` for them."""
        entries = list(entries)
        if not entries:  # a retrieve whose whole pinned prefix is READY cuts nothing
            return
        if read_bytes is not None and self._read_watcher is not None:
            self._read_watcher(entries)
        with self._lock:
            for entry in reversed(entries):  # head of the prefix = most recently used
                self._unpin(entry)
                if entry.pins == 0 and entry.state is EntryState.READY:
                    self._policy.add(entry.key)
            self._room.notify_all()
        if read_bytes is not None:
            self._publish(
                [
                    Event(
                        EventType.L1_READ_FINISHED,
                        L1ReadFinished(keys=[e.key for e in entries], num_bytes=read_bytes),
                    )
                ]
            )

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

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "allocated_bytes": self.allocated_bytes,
                "used_bytes": self.used_bytes,
                "num_chunks": len(self._entries),
                "evictable_chunks": len(self._policy),
                "tenant_bytes": self._policy.held(),
                "pinned_chunks": self._pinned,
                "waiting_writers": self._waiting_writers,
                "waiting_loaders": self._waiting_loaders,
                "pinned_memory": self.pin_memory,
                "allocation_failures": self.allocation_failures,
                "slabs": self._slabs.slab_info(),
            }


__all__ = ["SLOT_ALIGN", "EntryState", "L1Entry", "L1Pool", "SlotShape", "WriteReservation"]
