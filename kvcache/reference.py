"""Plain-torch gather/scatter between engine blocks and chunks: the oracle for the tests.

Built only from tensor views and indexing, independently of the native page table, so a
wrong row in ``csrc/layouts.def`` or a wrong offset in a kernel cannot agree with it by
accident. Slow and simple on purpose; never used on the data path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.geometry import Geometry
from kvcache.layouts import KVCaches, KVFormat, flatten_tensors


def page_view(kv_caches: KVCaches, fmt: KVFormat, shape: Geometry, layer: int, kv: int) -> torch.Tensor:
    """A writable view ``[NB, BS, NH*HS]`` of one (layer, kv) pair's blocks."""
    tensors = flatten_tensors(kv_caches, fmt)
    nb, bs = shape.num_blocks, shape.block_size
    if fmt is KVFormat.NB_NL_TWO_BS_NH_HS:
        view = tensors[0][:, layer, kv]
    elif fmt is KVFormat.NL_X_TWO_NB_BS_NH_HS:
        view = tensors[layer][kv]
    elif fmt is KVFormat.NL_X_NB_TWO_BS_NH_HS:
        view = tensors[layer][:, kv]
    elif fmt is KVFormat.NL_X_NB_BS_HS:
        view = tensors[layer]
    elif fmt is KVFormat.TWO_X_NL_X_NBBS_NH_HS:
        view = tensors[kv * shape.num_layers + layer].view(nb, bs, shape.num_heads, shape.head_size)
    else:  # SGLang MLA [NB*BS, 1, HS] and opaque pages [NB, ...]: a block is BS rows of HS
        view = tensors[layer].view(nb, bs, shape.head_size)
    return view.flatten(2) if view.dim() == 4 else view


def gather(kv_caches: KVCaches, fmt: KVFormat, shape: Geometry, block_ids: Sequence[int]) -> torch.Tensor:
    """The chunk ``[KV, NL, len(block_ids) * BS, NH*HS]`` holding these blocks in order."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)
    layers = []
    for kv in range(shape.kv_count):
        per_layer = []
        for layer in range(shape.num_layers):
            view = page_view(kv_caches, fmt, shape, layer, kv)
            per_layer.append(view[ids.to(view.device)].reshape(-1, view.shape[-1]))
        layers.append(torch.stack(per_layer))
    return torch.stack(layers)


def scatter(
    chunk: torch.Tensor,
    kv_caches: KVCaches,
    fmt: KVFormat,
    shape: Geometry,
    block_ids: Sequence[int],
    skip_blocks: int = 0,
) -> None:
    """Write ``chunk`` (as ``gather`` returns it) back into the blocks, leaving the first
    ``skip_blocks`` of them untouched."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)[skip_blocks:]
    bs = shape.block_size
    for kv in range(shape.kv_count):
        for layer in range(shape.num_layers):
            view = page_view(kv_caches, fmt, shape, layer, kv)
            data = chunk[kv, layer, skip_blocks * bs :].reshape(len(ids), bs, -1)
            view[ids.to(view.device)] = data.to(view.device)


__all__ = ["gather", "page_view", "scatter"]
