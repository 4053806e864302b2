"""The six engine KV layouts kvcache understands, and how to recognise them.

This is the Python view of ``csrc/layouts.def``: the stride rules live only there (the
native ``PageTable`` evaluates them); this module mirrors each row's id, K/V count, list
nesting and tensor rank for shape detection, and ``tests/test_layouts.py`` checks the
mirror against ``kvcache._native.layout_table()``.

``_X_`` in a name marks a Python list dimension. NL layers, NB blocks, BS block size
(tokens), NH KV heads, HS head size (the latent width for MLA).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache import _native
from kvcache.errors import LayoutError
from kvcache.geometry import DEFAULT_MAX_BLOCK_IDS, Geometry

# What an engine hands over: one tensor, a list of tensors, or [K_list, V_list].
KVCaches = torch.Tensor | Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]]


class KVFormat(enum.IntEnum):
    """Engine KV layouts; values are the stable ids of ``csrc/layouts.def``."""

    NB_NL_TWO_BS_NH_HS = 0  # vLLM cross-layer: one tensor [NB, NL, 2, BS, NH, HS]
    NL_X_TWO_NB_BS_NH_HS = 1  # vLLM FlashAttention: NL x [2, NB, BS, NH, HS]
    NL_X_NB_TWO_BS_NH_HS = 2  # vLLM FlashInfer: NL x [NB, 2, BS, NH, HS]
    NL_X_NB_BS_HS = 3  # vLLM MLA: NL x [NB, BS, HS]
    TWO_X_NL_X_NBBS_NH_HS = 4  # SGLang MHA: [K_list, V_list], each NL x [NB*BS, NH, HS]
    NL_X_NBBS_ONE_HS = 5  # SGLang MLA: NL x [NB*BS, 1, HS]
    NL_X_NB_PAGE = 6  # opaque pages: NL x [NB, ...], each block contiguous (vLLM CPU); never detected


@dataclass(frozen=True)
class LayoutRow:
    """One row of the layout table as Python needs it for detection."""

    kv: int  # 2 = K and V, 1 = MLA latent
    depth: int  # list nesting of the engine object
    rank: int  # rank of each tensor; 0 = any rank >= 2 (opaque pages)


LAYOUT_ROWS: dict[KVFormat, LayoutRow] = {
    KVFormat.NB_NL_TWO_BS_NH_HS: LayoutRow(kv=2, depth=0, rank=6),
    KVFormat.NL_X_TWO_NB_BS_NH_HS: LayoutRow(kv=2, depth=1, rank=5),
    KVFormat.NL_X_NB_TWO_BS_NH_HS: LayoutRow(kv=2, depth=1, rank=5),
    KVFormat.NL_X_NB_BS_HS: LayoutRow(kv=1, depth=1, rank=3),
    KVFormat.TWO_X_NL_X_NBBS_NH_HS: LayoutRow(kv=2, depth=2, rank=3),
    KVFormat.NL_X_NBBS_ONE_HS: LayoutRow(kv=1, depth=1, rank=3),
    KVFormat.NL_X_NB_PAGE: LayoutRow(kv=1, depth=1, rank=0),
}

ENGINES = ("vllm", "sglang")


def flatten_tensors(kv_caches: KVCaches, fmt: KVFormat) -> list[torch.Tensor]:
    """The engine tensors in the table's TENSOR order (SGLang MHA: all K, then all V)."""
    depth = LAYOUT_ROWS[fmt].depth
    if depth == 0:
        if not isinstance(kv_caches, torch.Tensor):
            raise LayoutError(f"{fmt.name} takes one tensor, got {type(kv_caches).__name__}")
        return [kv_caches]
    if isinstance(kv_caches, torch.Tensor):
        raise LayoutError(f"{fmt.name} takes a list of tensors, got a single tensor")
    if depth == 1:
        tensors = [t for t in kv_caches if isinstance(t, torch.Tensor)]
        if len(tensors) != len(kv_caches):
            raise LayoutError(f"{fmt.name} takes a list of tensors")
        return tensors
    parts = list(kv_caches)
    if len(parts) != 2 or any(isinstance(p, torch.Tensor) for p in parts):
        raise LayoutError(f"{fmt.name} takes [K_list, V_list]")
    k_list, v_list = (list(p) for p in parts)
    if len(k_list) != len(v_list):
        raise LayoutError(f"K has {len(k_list)} layers but V has {len(v_list)}")
    return [*k_list, *v_list]


def _depth(kv_caches: KVCaches) -> int:
    if isinstance(kv_caches, torch.Tensor):
        return 0
    items = list(kv_caches)
    if not items:
        raise LayoutError("empty KV cache list")
    if all(isinstance(t, torch.Tensor) for t in items):
        return 1
    if all(not isinstance(t, torch.Tensor) for t in items):
        return 2
    raise LayoutError("KV cache list mixes tensors and lists")


def detect_format(kv_caches: KVCaches, engine: str = "vllm") -> KVFormat:
    """Recognise the layout from list nesting, rank and the position of the K/V axis.

    Raises LayoutError for anything else, and for the one true ambiguity: a vLLM
    FlashAttention/FlashInfer cache with exactly two blocks, where both K/V axes read 2
    (pass ``fmt`` explicitly there).
    """
    if engine not in ENGINES:
        raise LayoutError(f"engine must be one of {ENGINES}, not {engine!r}")
    depth = _depth(kv_caches)
    if depth == 0:
        t = kv_caches
        assert isinstance(t, torch.Tensor)
        if engine == "vllm" and t.dim() == 6 and t.shape[2] == 2:
            return KVFormat.NB_NL_TWO_BS_NH_HS
        raise LayoutError(
            f"a single {engine} KV tensor must be [NB, NL, 2, BS, NH, HS]; got {tuple(t.shape)}"
        )
    if depth == 2:
        if engine == "sglang":
            inner = next(iter(kv_caches))
            first = next(iter(inner))
            if isinstance(first, torch.Tensor) and first.dim() == 3:
                return KVFormat.TWO_X_NL_X_NBBS_NH_HS
        raise LayoutError(f"[K_list, V_list] of [NB*BS, NH, HS] tensors is SGLang MHA only ({engine=})")
    first = next(iter(kv_caches))
    assert isinstance(first, torch.Tensor)
    shape = tuple(first.shape)
    if engine == "sglang":
        if first.dim() == 3 and shape[1] == 1:
            return KVFormat.NL_X_NBBS_ONE_HS
        raise LayoutError(f"SGLang layer tensors must be [NB*BS, 1, HS] (MLA); got {shape}")
    if first.dim() == 3:
        return KVFormat.NL_X_NB_BS_HS
    if first.dim() == 5:
        kv_first, kv_second = shape[0] == 2, shape[1] == 2
        if kv_first and kv_second:
            raise LayoutError(
                f"layer shape {shape} fits both FlashAttention [2, NB, ...] and FlashInfer "
                "[NB, 2, ...] (NB == 2): pass fmt= explicitly"
            )
        if kv_first:
            return KVFormat.NL_X_TWO_NB_BS_NH_HS
        if kv_second:
            return KVFormat.NL_X_NB_TWO_BS_NH_HS
    raise LayoutError(
        f"unrecognised vLLM layer tensor shape {shape}: expected [2, NB, BS, NH, HS], "
        "[NB, 2, BS, NH, HS] or [NB, BS, HS]"
    )


def describe(
    tensors: Sequence[torch.Tensor],
    fmt: KVFormat,
    block_size: int | None = None,
    *,
    chunk_size: int | None = None,
    max_block_ids: int = DEFAULT_MAX_BLOCK_IDS,
) -> Geometry:
    """The geometry of tensors already flattened by ``flatten_tensors``: NL, NB, BS, NH, HS
    read from their shapes, with chunks of ``chunk_size`` tokens (None: one block each)."""
    row = LAYOUT_ROWS[fmt]
    if not tensors:
        raise LayoutError("no KV tensors")
    shape = tuple(tensors[0].shape)
    dtype, device = tensors[0].dtype, tensors[0].device
    if fmt is KVFormat.NL_X_NB_PAGE:
        nl, nb, bs, nh, hs, kv = _describe_pages(tensors, block_size)
        return Geometry(nl, nb, bs, nh, hs, kv, dtype, device, chunk_size or bs, max_block_ids)
    if len(shape) != row.rank:
        raise LayoutError(f"{fmt.name} needs rank-{row.rank} tensors, got shape {shape}")
    n = len(tensors)
    if fmt is KVFormat.NB_NL_TWO_BS_NH_HS:
        nb, nl, _, bs, nh, hs = shape
    elif fmt is KVFormat.NL_X_TWO_NB_BS_NH_HS:
        nl, (_, nb, bs, nh, hs) = n, shape
    elif fmt is KVFormat.NL_X_NB_TWO_BS_NH_HS:
        nl, (nb, _, bs, nh, hs) = n, shape
    elif fmt is KVFormat.NL_X_NB_BS_HS:
        nl, nh, (nb, bs, hs) = n, 1, shape
    else:
        if block_size is None:
            raise LayoutError(f"{fmt.name} flattens NB*BS: block_size is required")
        nl = n // 2 if fmt is KVFormat.TWO_X_NL_X_NBBS_NH_HS else n
        nbbs, nh, hs = shape
        if block_size <= 0 or nbbs % block_size:
            raise LayoutError(f"{nbbs} token slots are not a whole number of {block_size}-token blocks")
        nb, bs = nbbs // block_size, block_size
    if block_size is not None and block_size != bs:
        raise LayoutError(f"block_size={block_size} disagrees with the tensors' block size {bs}")
    kv_axis = _KV_AXIS.get(fmt)
    if kv_axis is not None and shape[kv_axis] != 2:
        raise LayoutError(f"{fmt.name}: the K/V axis (dimension {kv_axis}) must be 2, got {shape[kv_axis]}")
    return Geometry(nl, nb, bs, nh, hs, row.kv, dtype, device, chunk_size or bs, max_block_ids)


# Which dimension of each tensor is the K/V axis, for the layouts that have one inside a tensor.
_KV_AXIS: dict[KVFormat, int] = {
    KVFormat.NB_NL_TWO_BS_NH_HS: 2,
    KVFormat.NL_X_TWO_NB_BS_NH_HS: 0,
    KVFormat.NL_X_NB_TWO_BS_NH_HS: 1,
}


def check_page_bounds(fmt: KVFormat, shape: Geometry, tensor_bytes: Sequence[int]) -> None:
    """Refuse a registration whose page table could address outside its tensors.

    For every (layer, K/V) the table of ``csrc/layouts.def`` places block 0 at a page offset
    inside one tensor and steps by a page stride per block id; the last block's page must end
    within that tensor's ``tensor_bytes``. ``describe`` reads the sizes from the shapes, so a
    consistent shape passes; this is the one check that does not trust that reading (a named
    layout whose axes disagree with the tensors was how a copy once ran past a tensor's end).
    The native page table checks the same again before any copy can use it.
    """
    placements, stride = _native.page_placements(int(fmt), shape.num_layers, shape.num_blocks)
    for lk, (tensor, offset) in enumerate(placements):
        end = (offset + (shape.num_blocks - 1) * stride + 1) * shape.page_bytes
        size = tensor_bytes[tensor] if 0 <= tensor < len(tensor_bytes) else 0
        if end > size:
            layer, kv = divmod(lk, shape.kv_count)
            raise LayoutError(
                f"{fmt.name}: the pages of layer {layer} kv {kv} would reach byte {end} of tensor "
                f"{tensor}, which holds {size} bytes (the tensors' shapes do not fit this layout)"
            )


def _describe_pages(
    tensors: Sequence[torch.Tensor], block_size: int | None
) -> tuple[int, int, int, int, int, int]:
    """Opaque pages: one block of one layer is ``numel / NB`` contiguous elements, seen as
    ``block_size`` tokens of equal width (one head of that width)."""
    shape = tuple(tensors[0].shape)
    if len(shape) < 2:
        raise LayoutError(f"NL_X_NB_PAGE needs tensors [NB, ...] of rank >= 2, got {shape}")
    if block_size is None or block_size <= 0:
        raise LayoutError("NL_X_NB_PAGE cannot see the block size inside a page: pass block_size")
    per_block = tensors[0][0].numel()
    if per_block % block_size:
        raise LayoutError(f"a page of {per_block} elements does not split into {block_size} tokens")
    return len(tensors), shape[0], block_size, 1, per_block // block_size, 1  # NL NB BS NH HS KV


__all__ = [
    "ENGINES",
    "LAYOUT_ROWS",
    "Geometry",
    "KVCaches",
    "KVFormat",
    "LayoutRow",
    "check_page_bounds",
    "describe",
    "detect_format",
    "flatten_tensors",
]
