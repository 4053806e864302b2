"""Sharing an engine's KV tensors with the daemon, without copying or pickling them: the one
entry point for both ends.

The engine flattens its ``kv_caches`` (``flatten_kv_caches``) and exports the tensors
(``export_tensors``): CPU tensors as sealed memfds (``memfd``), GPU tensors as CUDA IPC
handles (``cuda_ipc``). The daemon maps each descriptor back (``import_tensor``). Export and
import live side by side because they must agree byte for byte; the CUDA events that travel
with each request are in ``cuda_events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.errors import LayoutError
from kvcache.protocol.messages import FdTensor, TensorDesc, TensorNesting
from kvcache.transport.cuda_ipc import export_cuda_tensor, import_cuda_tensor
from kvcache.transport.fdproto import ReceivedFds
from kvcache.transport.memfd import export_cpu_tensors, import_fd_tensor

# -- engine side -------------------------------------------------------------------------


def flatten_kv_caches(kv_caches: Any) -> tuple[list[torch.Tensor], TensorNesting, list[int]]:
    """The tensors of an engine's ``kv_caches`` in order, and how to nest them again."""
    if isinstance(kv_caches, torch.Tensor):
        return [kv_caches], "tensor", []
    items = list(kv_caches)
    if items and all(isinstance(t, torch.Tensor) for t in items):
        return items, "list", []
    if items and all(isinstance(g, (list, tuple)) for g in items):
        groups = [list(g) for g in items]
        leaves = [t for g in groups for t in g]
        if leaves and all(isinstance(t, torch.Tensor) for t in leaves):
            return leaves, "nested", [len(g) for g in groups]
    raise LayoutError("kv_caches must be a tensor, a list of tensors, or a list of such lists")


def export_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorDesc], list[int]]:
    """Descriptors for an engine's KV tensors, and the memfds to hand over (CPU only)."""
    if tensors and all(t.is_cuda for t in tensors):
        return [export_cuda_tensor(t) for t in tensors], []
    if any(t.is_cuda for t in tensors):
        raise LayoutError("KV tensors must be all on GPUs or all on the CPU")
    descs, fds = export_cpu_tensors(tensors)
    return list(descs), fds


# -- daemon side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImportedTensor:
    """A tensor mapped from another process (its storage keeps the mapping alive)."""

    tensor: torch.Tensor


def import_tensor(desc: TensorDesc, received: ReceivedFds | None = None) -> ImportedTensor:
    """Map one descriptor; ``received`` holds the memfds an ``FdTensor`` points into."""
    if isinstance(desc, FdTensor):
        return ImportedTensor(import_fd_tensor(desc, received))
    return ImportedTensor(import_cuda_tensor(desc))


__all__ = ["ImportedTensor", "export_tensors", "flatten_kv_caches", "import_tensor"]
