"""No accepted registration can address outside its tensors (issue 20, finding 1).

A property test: random formats, shapes, list nestings, dtypes, strides and block sizes are
handed to ``CacheContext``; whatever it accepts, every page its native table can form
(every (layer, K/V) and every block id) must lie inside one of the registered tensors'
bytes. The oracle is the tensors' own address ranges, not ``csrc/layouts.def``, so a wrong
row or a shape the layout misreads fails it. The native table's own guard is checked
separately, for every layout, with sizes one byte too small.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import _native
from kvcache.context import CacheContext
from kvcache.errors import LayoutError
from kvcache.layouts import LAYOUT_ROWS, KVFormat, check_page_bounds, describe, flatten_tensors
from kvcache.testing import make_kv_caches

DIM = st.integers(min_value=1, max_value=4)


@st.composite
def _tensor(draw: st.DrawFn, rank: int) -> torch.Tensor:
    shape = [draw(DIM) for _ in range(rank)]
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.uint8]))
    t = torch.zeros(shape, dtype=dtype)
    how = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if how == "transposed" and rank >= 2:
        t = t.transpose(0, rank - 1)
    elif how == "sliced" and shape[0] > 1:
        t = t[1:]
    return t


@st.composite
def _registration(draw: st.DrawFn) -> tuple[Any, KVFormat, str, int | None]:
    """An engine object of random nesting and shapes, and the layout it claims."""
    fmt = draw(st.sampled_from(list(KVFormat)))
    depth = draw(st.sampled_from([0, 1, 2, LAYOUT_ROWS[fmt].depth, LAYOUT_ROWS[fmt].depth]))
    rank = draw(st.sampled_from([2, 3, 5, 6, LAYOUT_ROWS[fmt].rank or 3, LAYOUT_ROWS[fmt].rank or 4]))
    same = draw(st.booleans())  # all tensors alike (most get past the shape checks) or not
    first = draw(_tensor(rank))

    def one() -> torch.Tensor:
        return torch.zeros_like(first) if same else draw(_tensor(rank))

    kv: Any
    if depth == 0:
        kv = first
    elif depth == 1:
        kv = [first] + [one() for _ in range(draw(st.integers(0, 3)))]
    else:
        kv = [[first] + [one() for _ in range(draw(st.integers(0, 2)))],
              [one() for _ in range(draw(st.integers(0, 3)))]]  # fmt: skip
    engine = draw(st.sampled_from(["vllm", "sglang"]))
    block_size = draw(st.one_of(st.none(), st.integers(1, 4)))
    return kv, fmt, engine, block_size


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_registration())
def test_no_accepted_registration_addresses_outside_its_tensors(
    reg: tuple[Any, KVFormat, str, int | None],
) -> None:
    kv, fmt, engine, block_size = reg
    try:
        ctx = CacheContext(kv, chunk_size=4 * (block_size or 4), fmt=fmt, engine=engine,
                              block_size=block_size)  # fmt: skip
    except LayoutError:
        return  # refused: nothing to address
    table = ctx._table
    ranges = _ranges(ctx.tensors)
    for lk, base in enumerate(table.base):
        for b in range(table.num_blocks):
            start = base + b * table.block_stride_bytes
            end = start + table.page_bytes
            assert any(lo <= start and end <= hi for lo, hi in ranges), (
                f"{fmt.name} shapes {[tuple(t.shape) for t in ctx.tensors]}: page (lk={lk}, "
                f"block {b}) at [{start}, {end}) is outside every tensor {ranges}"
            )


@pytest.mark.parametrize("fmt", list(KVFormat))
def test_the_native_table_refuses_sizes_one_byte_short(fmt: KVFormat) -> None:
    """Defence in depth: even a caller that skipped the registration check gets no table."""
    nh = 1 if fmt is KVFormat.NL_X_NBBS_ONE_HS else 2
    kv = make_kv_caches(fmt, num_layers=2, num_blocks=4, block_size=4, num_heads=nh, head_size=8)
    tensors = flatten_tensors(kv, fmt)
    shape = describe(tensors, fmt, block_size=4)
    ptrs = [t.data_ptr() for t in tensors]
    sizes = [t.numel() * t.element_size() for t in tensors]
    _native.PageTable(int(fmt), shape.num_layers, shape.num_blocks, shape.page_bytes, ptrs, sizes)
    check_page_bounds(fmt, shape, sizes)
    for i in range(len(sizes)):
        short = list(sizes)
        short[i] -= 1
        with pytest.raises(ValueError, match="would reach byte"):
            _native.PageTable(int(fmt), shape.num_layers, shape.num_blocks, shape.page_bytes, ptrs, short)
        with pytest.raises(LayoutError, match="would reach byte"):
            check_page_bounds(fmt, shape, short)


def test_a_named_layout_with_one_kv_entry_is_refused_with_the_reason() -> None:
    kv = [torch.zeros(1, 4, 4, 2, 8, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(LayoutError, match="K/V axis"):
        CacheContext(kv, chunk_size=16, fmt=KVFormat.NL_X_TWO_NB_BS_NH_HS)
