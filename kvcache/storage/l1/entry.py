"""The records the L1 pool hands out: one resident chunk (``L1Entry``), its states, a reservation.

Separate from the pool because these are what the engine holds and copies through, without the
pool's lock; the pool's bookkeeping (slots, pins, eviction) stays behind its own API.

Entry states: WRITING (a store is copying in), LOADING (a prefetch from L2), READY. Lookups count
WRITING-free entries (READY or LOADING: a retrieve waits for the load); readers and writers pin an
entry (a refcount) and a pinned or unfinished entry is never evicted.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcache.records import ChunkKey
from kvcache.storage.l1.slab import SlotShape


class EntryState(enum.Enum):
    WRITING = "writing"
    LOADING = "loading"
    READY = "ready"


class L1Entry:
    """One resident chunk. ``tensor`` is a view into the pool, valid while the entry is pinned."""

    __slots__ = (
        "_done",
        "_extent",
        "_offset",
        "from_l2",
        "in_l2",
        "key",
        "ok",
        "pins",
        "slot_shape",
        "state",
        "tenant",
        "tensor",
        "watchers",
    )

    def __init__(
        self,
        key: ChunkKey,
        slot_shape: SlotShape,
        tensor: torch.Tensor,
        extent: int,
        offset: int,
        tenant: str = "",
    ) -> None:
        self.key = key
        self.tenant = tenant  # whose share of L1 it counts against (``storage.shares``)
        self.slot_shape = slot_shape
        self.tensor = tensor
        self.state = EntryState.WRITING
        self.pins = 1
        self.ok = True
        self.from_l2 = False  # brought up by a prefetch and not yet read by a retrieve
        self.in_l2 = False  # loaded from an L2 tier: a hit on it never promotes it to one
        self._extent = extent
        self._offset = offset
        self._done = threading.Event()
        self.watchers: list[Callable[[L1Entry], None]] | None = None  # ``SlotTable.on_settled``

    @property
    def nbytes(self) -> int:
        return self.slot_shape.nbytes

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until a WRITING/LOADING entry settles; True when it became READY."""
        return self._done.wait(timeout) and self.ok


@dataclass(frozen=True, slots=True)
class WriteReservation:
    """Result of ``begin_write``: which chunk indices got a fresh slot, which were present,
    how many trailing chunks failed, and how many leading keys it ``settled`` (all of them,
    except for a partial reservation that stopped to let its caller write what it holds).

    ``loading``: the present ones an L2 prefetch was still loading (index and entry, also in
    ``present``). Such a load may yet fail (a corrupt or lost L2 copy) and drop its entry; a
    writer holding the chunk's bytes watches them (``SlotTable.on_settled``). Entries another
    store is writing are not listed: that store holds the same bytes, and its own wait for
    room (up to ``store_wait_timeout_s``) must not become this one's."""

    new: list[tuple[int, L1Entry]]
    present: list[int]
    failed: int
    settled: int
    loading: list[tuple[int, L1Entry]] = field(default_factory=list)


__all__ = ["EntryState", "L1Entry", "WriteReservation"]
