"""Opt-in: SGLang's host KV pools allocated in kvcache sealed memfds, so the daemon maps them.

With the pool in such memory (and the ``layer_first`` layout) the backend registers the pool
itself and the daemon copies pages straight between it and L1: no staging copy. SGLang builds
its host pool before it loads a storage backend, so this must run first, in every process that
builds one (the scheduler), e.g. from a ``sitecustomize`` on the server's ``PYTHONPATH``::

    import kvcache.integrations.sglang.shared_pool as s; s.install()

Only SGLang's default host allocator is replaced (``HostTensorAllocator.allocate``, CPU only);
pinning for CUDA (``cudaHostRegister``) still applies on top, as it does to any host memory.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcache.transport.memfd import empty_shared

_saved: dict[str, Any] = {}


def install() -> None:
    """Make SGLang's default host allocator return sealed-memfd tensors (idempotent)."""
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

    if "allocate" in _saved:
        return
    _saved["allocate"] = HostTensorAllocator.allocate

    def allocate(self: Any, dims: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"host pools are CPU memory, not {device!r}")
        self.dtype, self.dims = dtype, dims
        return empty_shared(dims, dtype)

    HostTensorAllocator.allocate = allocate


def uninstall() -> None:
    """Undo ``install`` (tests)."""
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

    if "allocate" in _saved:
        HostTensorAllocator.allocate = _saved.pop("allocate")


__all__ = ["install", "uninstall"]
