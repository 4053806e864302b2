"""What a tensor descriptor means on both ends: the dtype names they agree on, and the bytes a
shape and its strides span.

Its own module because the memfd and the CUDA IPC paths (``memfd``, ``cuda_ipc``) both check a
descriptor the same way before mapping anything, and the daemon bounds a registration by
``descriptor_bytes`` before it maps a single page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcache.errors import LayoutError
from kvcache.protocol.messages import TensorDesc
from kvcache.records import dtype_name

_INT64_MAX = (1 << 63) - 1
"""Every size and stride of a view, and its element count times the widest dtype, must fit
torch's int64 (or ``as_strided`` fails with a native error instead of a ``LayoutError``)."""

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "uint8", "int16", "int32", "int64",
    )
    if hasattr(torch, name)
}  # fmt: skip


def shared_dtype_name(dtype: torch.dtype) -> str:
    """``records.dtype_name``, refused for a dtype the daemon cannot share."""
    name = dtype_name(dtype)
    if name not in _DTYPES:
        raise LayoutError(f"dtype {dtype} cannot be shared with the daemon")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a view's first to its last, inclusive (0 for an empty view)."""
    if len(shape) != len(stride):
        raise LayoutError(f"shape {list(shape)} and stride {list(stride)} differ in rank")
    if any(not 0 <= v <= _INT64_MAX for v in (*shape, *stride)) or math.prod(shape) > _INT64_MAX // 16:
        raise LayoutError(f"shape {list(shape)} or stride {list(stride)} does not fit a tensor (int64)")
    if any(d == 0 for d in shape):
        return 0
    return sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1


def descriptor_bytes(desc: TensorDesc) -> int:
    """Bytes a descriptor's view spans, from its shape and strides (before mapping anything)."""
    return span_elements(desc.shape, desc.stride) * itemsize(dtype_from_name(desc.dtype))


__all__ = ["descriptor_bytes", "dtype_from_name", "itemsize", "shared_dtype_name", "span_elements"]
