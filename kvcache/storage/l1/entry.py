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
from dataclasses import dataclass

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
        "key",
        "ok",
        "pins",
        "slot_shape",
        "state",
        "tensor",
    )

    def __init__(
        self, key: ChunkKey, slot_shape: SlotShape, tensor: torch.Tensor, extent: int, offset: int
    ) -> None:
        self.key = key
        self.slot_shape = slot_shape
        self.tensor = tensor
        self.state = EntryState.WRITING
        self.pins = 1
        self.ok = True
        self.from_l2 = False  # brought up by a prefetch and not yet read by a retrieve
        self._extent = extent
        self._offset = offset
        self._done = threading.Event()

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
    except for a partial reservation that stopped to let its caller write what it holds)."""

    new: list[tuple[int, L1Entry]]
    present: list[int]
    failed: int
    settled: int


__all__ = ["EntryState", "L1Entry", "WriteReservation"]
