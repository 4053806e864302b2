from __future__ import annotations

import pytest
import torch

from kvcache import _native
from kvcache.errors import KvcacheError, LayoutError
from kvcache.layouts import LAYOUT_ROWS, KVFormat, describe, detect_format, flatten_tensors
from kvcache.testing import ALL_FORMATS, ENGINE_OF, make_kv_caches

DETECTABLE = [f for f in ALL_FORMATS if f is not KVFormat.NL_X_NB_PAGE]


def test_python_mirror_matches_native_table() -> None:
    native = {row["name"]: row for row in _native.layout_table()}
    assert set(native) == {f.name for f in KVFormat}
    for fmt, row in LAYOUT_ROWS.items():
        n = native[fmt.name]
        assert (n["id"], n["kv"], n["depth"], n["rank"]) == (int(fmt), row.kv, row.depth, row.rank)


def test_the_six_engine_formats_and_opaque_pages() -> None:
    assert [f.name for f in KVFormat] == [
        "NB_NL_TWO_BS_NH_HS",
        "NL_X_TWO_NB_BS_NH_HS",
        "NL_X_NB_TWO_BS_NH_HS",
        "NL_X_NB_BS_HS",
        "TWO_X_NL_X_NBBS_NH_HS",
        "NL_X_NBBS_ONE_HS",
        "NL_X_NB_PAGE",
    ]


@pytest.mark.parametrize("fmt", DETECTABLE)
def test_detect_each_format(fmt: KVFormat) -> None:
    caches = make_kv_caches(fmt, num_layers=3, num_blocks=5, fill=False)
    assert detect_format(caches, ENGINE_OF[fmt]) is fmt


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_describe_reads_geometry(fmt: KVFormat) -> None:
    caches = make_kv_caches(
        fmt,
        num_layers=3,
        num_blocks=5,
        block_size=16,
        num_heads=4,
        head_size=32,
        dtype=torch.float16,
        fill=False,
    )
    shape = describe(flatten_tensors(caches, fmt), fmt, block_size=16)
    mla = LAYOUT_ROWS[fmt].kv == 1
    assert (shape.num_layers, shape.num_blocks, shape.block_size) == (3, 5, 16)
    assert shape.num_heads == (1 if mla else 4)
    assert shape.head_size == (4 * 2 * 32 if fmt is KVFormat.NL_X_NB_PAGE else 32)
    assert shape.element_size == 2
    assert shape.kv_count == (1 if mla else 2)
    assert shape.page_bytes == 16 * shape.num_heads * shape.head_size * 2


def test_opaque_pages_are_never_guessed() -> None:
    caches = make_kv_caches(KVFormat.NL_X_NB_PAGE, fill=False)  # vLLM CPU [NB, NH, BS, 2*HS]
    with pytest.raises(LayoutError):
        detect_format(caches)
    fmt = KVFormat.NL_X_NB_PAGE
    with pytest.raises(LayoutError, match="block_size"):
        describe(flatten_tensors(caches, fmt), fmt)
    shape = describe(flatten_tensors(caches, fmt), fmt, block_size=16)
    # a page is NH * BS * 2*HS elements; seen as 16 tokens of NH * 2*HS
    assert (shape.num_blocks, shape.num_heads, shape.head_size, shape.kv_count) == (8, 1, 2 * 2 * 64, 1)


def test_flash_attention_with_two_blocks_is_ambiguous() -> None:
    caches = [torch.empty(2, 2, 16, 2, 8) for _ in range(2)]
    with pytest.raises(LayoutError, match="explicitly"):
        detect_format(caches)


@pytest.mark.parametrize(
    "caches, engine",
    [
        (torch.empty(4, 4), "vllm"),
        ([torch.empty(3, 4, 5, 6)], "vllm"),
        ([torch.empty(4, 2, 8)], "sglang"),
        ([], "vllm"),
        ([torch.empty(2, 4, 16, 2, 8)], "tensorrt"),
        ([torch.empty(2, 3), [torch.empty(2)]], "vllm"),
    ],
)
def test_unrecognised_shapes_raise(caches: object, engine: str) -> None:
    with pytest.raises(LayoutError):
        detect_format(caches, engine)  # type: ignore[arg-type]


def test_layout_error_is_value_error_and_kvcache_error() -> None:
    assert issubclass(LayoutError, ValueError)
    assert issubclass(LayoutError, KvcacheError)


def test_sglang_needs_block_size() -> None:
    fmt = KVFormat.NL_X_NBBS_ONE_HS
    caches = make_kv_caches(fmt, fill=False)
    with pytest.raises(LayoutError, match="block_size"):
        describe(flatten_tensors(caches, fmt), fmt)
    with pytest.raises(LayoutError, match="whole number"):
        describe(flatten_tensors(caches, fmt), fmt, block_size=48)


def test_block_size_checked_against_shape() -> None:
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    caches = make_kv_caches(fmt, block_size=16, fill=False)
    with pytest.raises(LayoutError, match="disagrees"):
        describe(flatten_tensors(caches, fmt), fmt, block_size=32)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_native_page_placements_cover_each_page_once(fmt: KVFormat) -> None:
    nl, nb = 3, 5
    places, stride = _native.page_placements(int(fmt), nl, nb)
    ntensors = _native.expected_num_tensors(int(fmt), nl)
    pages = {(t, off + b * stride) for t, off in places for b in range(nb)}
    assert len(pages) == len(places) * nb  # no two (layer, kv, block) share a page
    per_tensor = len(pages) // ntensors
    assert all(0 <= t < ntensors for t, _ in pages)
    assert max(p for _, p in pages) == per_tensor - 1  # pages tile each tensor exactly
