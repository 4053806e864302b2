"""The L1 slot allocator: one slab per slot shape, grown by extents carved into aligned slots.

Separate from the pool because it is pure memory arithmetic, with no keys, pins or eviction: the
pool decides *what* leaves, this module only says whether a slot can be had and which bytes it is.

One *slab* per slot shape (shape + dtype of a chunk; instances of the same model share one).
A slab grows lazily by *extents*: one allocation of ``extent_bytes`` (at least one slot), carved
into fixed-size slots whose stride is the chunk size rounded up to 256 bytes, so every view is
aligned for DMA and any dtype. Fixed slots cannot fragment: when enough bytes are free a slot is
free. The sum of extents never exceeds ``capacity_bytes``, and one extent is at most a quarter of
it (when that holds a slot), so a pool smaller than a few extents still leaves room for another
slot shape instead of handing all of it to the first one.

Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

SLOT_ALIGN = 256
#: An extent is at most ``capacity_bytes // EXTENT_SHARE`` (but always at least one slot).
EXTENT_SHARE = 4


@dataclass(frozen=True, slots=True)
class SlotShape:
    """Shape and dtype of one chunk; the unit a slab is carved in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int = field(init=False, compare=False, repr=False)
    """Bytes of one chunk."""
    stride: int = field(init=False, compare=False, repr=False)
    """Bytes between two slots: ``nbytes`` rounded up to ``SLOT_ALIGN``."""

    def __post_init__(self) -> None:
        # Computed once: the pool reads them under its lock on every allocation and eviction,
        # and asking torch for an element size there cost microseconds each time.
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "stride", -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)


class Slot(NamedTuple):
    """A slot handed out by ``SlabAllocator.take``: where it lives and its typed view."""

    extent: int
    offset: int
    tensor: torch.Tensor


class _Extent:
    __slots__ = ("buf", "free", "nslots")

    def __init__(self, buf: torch.Tensor, offsets: list[int]) -> None:
        self.buf = buf
        self.free = offsets
        self.nslots = len(offsets)


@dataclass(slots=True)
class _Slab:
    slot_shape: SlotShape
    extents: dict[int, _Extent] = field(default_factory=dict)
    avail: dict[int, _Extent] = field(default_factory=dict)  # extents with a free slot


class SlabAllocator:
    """Slots of every shape within one byte budget; extents are (pinned) host tensors."""

    def __init__(self, capacity_bytes: int, extent_bytes: int, pin_memory: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.extent_bytes = extent_bytes
        self.pin_memory = pin_memory
        self._slabs: dict[SlotShape, _Slab] = {}
        self._next_extent = 0
        self.allocated_bytes = 0  # sum of extents

    def take(self, slot_shape: SlotShape) -> Slot | None:
        """A free slot of ``slot_shape``, growing its slab within the budget; None when full."""
        slab = self._slabs.get(slot_shape)
        if slab is None:
            slab = self._slabs[slot_shape] = _Slab(slot_shape)
        if not slab.avail and not self._grow(slab):
            return None
        ext_id, ext = next(iter(slab.avail.items()))
        offset = ext.free.pop()
        if not ext.free:
            del slab.avail[ext_id]
        view = ext.buf[offset : offset + slot_shape.nbytes].view(slot_shape.dtype).view(slot_shape.shape)
        return Slot(ext_id, offset, view)

    def free(self, slot_shape: SlotShape, extent: int, offset: int) -> None:
        """Return a slot that ``take`` handed out."""
        slab = self._slabs[slot_shape]
        ext = slab.extents[extent]
        ext.free.append(offset)
        slab.avail[extent] = ext

    def reclaim_for(self, slot_shape: SlotShape) -> bool:
        """Release the wholly free extents of the first other slab that has any; True if it did."""
        return any(self._release_free_extents(s) for g, s in self._slabs.items() if g != slot_shape)

    def release_free_extents(self) -> None:
        """Release every wholly free extent of every slab."""
        for slab in self._slabs.values():
            self._release_free_extents(slab)

    def slab_info(self) -> list[dict[str, Any]]:
        return [
            {
                "shape": list(s.slot_shape.shape),
                "dtype": str(s.slot_shape.dtype).removeprefix("torch."),
                "extents": len(s.extents),
                "slots": sum(x.nslots for x in s.extents.values()),
            }
            for s in self._slabs.values()
        ]

    def _grow(self, slab: _Slab) -> bool:
        stride = slab.slot_shape.stride
        room = (self.capacity_bytes - self.allocated_bytes) // stride
        extent = min(self.extent_bytes, max(stride, self.capacity_bytes // EXTENT_SHARE))
        n = min(max(1, extent // stride), room)
        if n < 1:
            return False
        try:
            raw = torch.empty(n * stride + SLOT_ALIGN, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError:  # out of (pinned) host memory: behave as a full pool
            return False
        shift = -raw.data_ptr() % SLOT_ALIGN  # the allocator guarantees less than we promise
        buf = raw[shift : shift + n * stride]
        ext_id = self._next_extent
        self._next_extent += 1
        ext = _Extent(buf, [i * stride for i in reversed(range(n))])
        slab.extents[ext_id] = ext
        slab.avail[ext_id] = ext
        self.allocated_bytes += n * stride
        return True

    def _release_free_extents(self, slab: _Slab) -> bool:
        freed = [i for i, x in slab.extents.items() if len(x.free) == x.nslots]
        for ext_id in freed:
            ext = slab.extents.pop(ext_id)
            slab.avail.pop(ext_id, None)
            self.allocated_bytes -= ext.nslots * slab.slot_shape.stride
        return bool(freed)


__all__ = ["EXTENT_SHARE", "SLOT_ALIGN", "SlabAllocator", "Slot", "SlotShape"]
