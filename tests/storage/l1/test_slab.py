"""SlabAllocator: extents capped at a share of the budget, slot reuse, releasing free extents."""

from __future__ import annotations

import pytest
import torch

from kvcache.storage.l1.slab import EXTENT_SHARE, SlabAllocator, SlotShape

G = SlotShape((2, 2, 16, 64), torch.bfloat16)  # 8 KiB per chunk
G2 = SlotShape((1, 3, 16, 32), torch.float32)  # 6 KiB per chunk


def test_an_extent_never_takes_the_whole_budget() -> None:
    a = SlabAllocator(8 * G.stride, extent_bytes=1 << 30, pin_memory=False)
    slot = a.take(G)
    assert slot is not None and a.allocated_bytes == 8 * G.stride // EXTENT_SHARE
    assert a.take(G2) is not None  # another geometry finds room without anything being freed
    assert a.allocated_bytes <= 8 * G.stride


def test_an_extent_holds_at_least_one_slot_and_slots_are_reused() -> None:
    a = SlabAllocator(2 * G.stride, extent_bytes=1, pin_memory=False)
    first = a.take(G)
    assert first is not None and a.allocated_bytes == G.stride
    a.free(G, first.extent, first.offset)
    again = a.take(G)
    assert again is not None and (again.extent, again.offset) == (first.extent, first.offset)
    assert again.tensor.shape == G.shape and again.tensor.data_ptr() % 256 == 0
    assert a.take(G) is not None and a.take(G) is None  # the budget holds two slots


def test_reclaim_releases_other_slabs_only() -> None:
    a = SlabAllocator(4 * G.stride, extent_bytes=G.stride, pin_memory=False)
    slots = [a.take(G) for _ in range(4)]
    assert all(s is not None for s in slots) and a.take(G2) is None
    assert not a.reclaim_for(G2)  # nothing wholly free yet
    for s in slots[:2]:
        assert s is not None
        a.free(G, s.extent, s.offset)
    assert not a.reclaim_for(G)  # its own free extents are not reclaimed for it
    assert a.reclaim_for(G2) and a.allocated_bytes == 2 * G.stride
    assert a.take(G2) is not None
    a.release_free_extents()
    assert a.slab_info()[0]["extents"] == 2


def test_a_slot_shape_knows_its_sizes_without_asking_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    odd = SlotShape((1, 1, 3), torch.float16)  # 6 bytes: one aligned stride
    assert (G.nbytes, G.stride) == (2 * 2 * 16 * 64 * 2, 2 * 2 * 16 * 64 * 2)
    assert (odd.nbytes, odd.stride) == (6, 256)
    # Read under the pool's lock on every allocation: computed once, at construction.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("torch.empty called"))
    assert (odd.nbytes, odd.stride) == (6, 256)
    # The sizes are derived: equal shapes are one slab's key, whatever was computed.
    assert SlotShape((1, 1, 3), torch.float16) == odd and len({odd, SlotShape((1, 1, 3), torch.float16)}) == 1
