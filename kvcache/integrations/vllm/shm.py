"""Put vLLM's CPU KV cache in sealed memfds, so the daemon can map it.

The daemon reads and writes the engine's KV blocks in place; for CPU tensors that needs
memory both processes map (a memfd handed to the daemon over its Unix fd socket), and vLLM
allocates its cache with a plain ``torch.zeros``. vLLM
lets a connector wrap that allocation in a context manager (``get_mem_pool_context``), so
``SharedKVAllocation`` is a ``TorchFunctionMode`` that answers the CPU ``torch.zeros`` calls
made inside it with ``empty_shared`` buffers (zero-filled, like ``torch.zeros``). Nothing is
copied and no tensor is swapped behind vLLM's back: its views are built on the shared buffer
from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvcache.transport.memfd import empty_shared


def _shape(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    size: Any = kwargs.get("size", args[0] if len(args) == 1 else list(args))
    if isinstance(size, int):
        return [size]
    if isinstance(size, (list, tuple, torch.Size)) and all(isinstance(d, int) for d in size):
        return [int(d) for d in size]
    return None


class SharedKVAllocation(TorchFunctionMode):
    """Inside ``with``, CPU ``torch.zeros`` of at least ``min_bytes`` lands in a sealed memfd.

    ``buffers`` keeps what was allocated (and so the memfds) alive as long as this object.
    """

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.buffers: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and "out" not in kwargs:
            shape = _shape(args, kwargs)
            device = torch.device(kwargs.get("device") or "cpu")
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if shape is not None and device.type == "cpu" and not kwargs.get("requires_grad"):
                numel = 1
                for d in shape:
                    numel *= d
                if numel * torch.empty((), dtype=dtype).element_size() >= self.min_bytes:
                    buf = empty_shared(shape, dtype)
                    self.buffers.append(buf)
                    return buf
        return func(*args, **kwargs)


__all__ = ["SharedKVAllocation"]
