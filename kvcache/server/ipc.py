"""Moving tensors between an engine process and the daemon without copying or pickling them.

Both ends live here because export and import must agree byte for byte: the engine side
(``empty_shared``, ``export_tensor``, ``record_ipc_event``) and the daemon side
(``import_tensor``, ``wait_ipc_event``, ``remove_orphaned_segment``).

CPU tensors travel as a file under /dev/shm plus shape, stride, dtype and byte offset; the
daemon maps the same file, so a store reads the engine's memory directly. GPU tensors
travel as CUDA IPC handle bytes plus typed fields, mapped by device UUID (two processes may
number their GPUs differently). A CPU tensor not backed by a /dev/shm file cannot be shared:
allocate the engine's KV cache with ``empty_shared``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.protocol.messages import CudaIpcTensor, ShmTensor, TensorDesc, TensorNesting

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvcache-"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "uint8", "int16", "int32", "int64",
    )
    if hasattr(torch, name)
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise LayoutError(f"dtype {dtype} cannot be shared with the daemon")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


# -- engine side: CPU ------------------------------------------------------------------


class _Segment(mmap.mmap):
    """An mmap that can carry a weakref finalizer (plain ``mmap.mmap`` cannot)."""


def empty_shared(shape: Sequence[int], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A zero-filled CPU tensor in a fresh /dev/shm file that the daemon can map.

    The file is removed when the last tensor viewing it is freed (or at interpreter exit);
    if the process is killed instead, the daemon removes it once the owner pid is gone.
    """
    numel = 1
    for dim in shape:
        numel *= int(dim)
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        segment = _Segment(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    weakref.finalize(segment, _unlink_quietly, path)
    flat = torch.frombuffer(segment, dtype=torch.uint8)[: numel * _itemsize(dtype)]
    return flat.view(dtype).view(tuple(int(d) for d in shape))


def to_shared(kv_caches: Any) -> Any:
    """A copy of a CPU KV cache (tensor, list, or list of lists) in shared memory."""
    if isinstance(kv_caches, torch.Tensor):
        return empty_shared(kv_caches.shape, kv_caches.dtype).copy_(kv_caches)
    return [to_shared(x) for x in kv_caches]


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


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _find_shm_mapping(address: int) -> tuple[str, int] | None:
    """(file path, file offset of ``address``) when ``address`` lies in a /dev/shm mapping."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith(SHM_DIR + "/"):
                continue
            start_s, end_s = parts[0].split("-")
            start, end = int(start_s, 16), int(end_s, 16)
            if start <= address < end:
                path = parts[5].rstrip("\n")
                if path.endswith(" (deleted)"):
                    return None
                return path, int(parts[2], 16) + (address - start)
    return None


def export_cpu_tensor(tensor: torch.Tensor) -> ShmTensor:
    if tensor.numel() == 0:
        raise LayoutError("cannot share an empty KV tensor")
    found = _find_shm_mapping(tensor.data_ptr())
    if found is None:
        raise LayoutError(
            "CPU KV tensors must live in shared memory for the daemon to map them; "
            "allocate them with kvcache.client.empty_shared(shape, dtype)"
        )
    path, offset = found
    return ShmTensor(
        path=path,
        offset=offset,
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        dtype=dtype_name(tensor.dtype),
        owner_pid=os.getpid(),
    )


# -- engine side: CUDA -----------------------------------------------------------------


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIpcTensor:
    storage = tensor.untyped_storage()
    (device, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle, ev_sync) = (
        storage._share_cuda_()
    )
    return CudaIpcTensor(
        device_uuid=device_uuid(int(device)),
        ipc_handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=bytes(ev_handle) if ev_handle else b"",
        event_sync_required=bool(ev_sync),
        storage_offset=int(tensor.storage_offset()),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        dtype=dtype_name(tensor.dtype),
    )


def export_tensor(tensor: torch.Tensor) -> TensorDesc:
    return export_cuda_tensor(tensor) if tensor.is_cuda else export_cpu_tensor(tensor)


def record_ipc_event(device: torch.device) -> bytes:
    """Record an interprocess event on ``device``'s current stream; returns its handle."""
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(device))
    return bytes(event.ipc_handle())


def wait_ipc_event(handle: bytes, device: torch.device) -> None:
    """Block the calling thread until an event another process recorded has completed.

    NOTE: a host wait, not ``stream.wait_event``: the copies run on the cache context's own
    stream, which the caller does not hold, so only a host-side wait orders them after it.
    """
    torch.cuda.Event.from_ipc_handle(device, handle).synchronize()


# -- daemon side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImportedTensor:
    """A tensor mapped from another process; ``owner_pid``/``path`` serve orphan cleanup."""

    tensor: torch.Tensor
    path: str = ""
    owner_pid: int = 0


def import_tensor(desc: TensorDesc) -> ImportedTensor:
    if isinstance(desc, ShmTensor):
        return ImportedTensor(_import_shm(desc), desc.path, desc.owner_pid)
    return ImportedTensor(_import_cuda(desc))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    if len(shape) != len(stride):
        raise LayoutError(f"shape {list(shape)} and stride {list(stride)} differ in rank")
    if any(d == 0 for d in shape):
        return 0
    return sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1


def _import_shm(desc: ShmTensor) -> torch.Tensor:
    path = os.path.realpath(desc.path)
    if os.path.dirname(path) != SHM_DIR:
        raise LayoutError(f"shared-memory tensors must be files directly under {SHM_DIR}")
    dtype = dtype_from_name(desc.dtype)
    itemsize = _itemsize(dtype)
    span = _span_elements(desc.shape, desc.stride) * itemsize
    if span == 0:
        raise LayoutError("cannot map an empty KV tensor")
    if desc.offset % itemsize:
        raise LayoutError(f"offset {desc.offset} is not aligned to {desc.dtype}")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise LayoutError(f"cannot open shared-memory tensor {path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if desc.offset + span > size:
            raise LayoutError(
                f"tensor needs bytes [{desc.offset}, {desc.offset + span}) of {path}, "
                f"which has {size}"
            )
        segment = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    flat = torch.frombuffer(segment, dtype=torch.uint8)[desc.offset : desc.offset + span]
    return flat.view(dtype).as_strided(desc.shape, desc.stride)


def _cuda_device_for_uuid(uuid: str) -> int:
    if not torch.cuda.is_available():
        raise CudaUnavailableError("the engine shared CUDA tensors but the daemon sees no GPU")
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise CudaUnavailableError(f"no GPU with UUID {uuid} is visible to the daemon")


def _import_cuda(desc: CudaIpcTensor) -> torch.Tensor:
    index = _cuda_device_for_uuid(desc.device_uuid)
    dtype = dtype_from_name(desc.dtype)
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        desc.ipc_handle,
        desc.storage_size_bytes,
        desc.storage_offset_bytes,
        desc.ref_counter_handle,
        desc.ref_counter_offset,
        desc.event_handle or None,
        desc.event_sync_required,
    )
    tensor = torch.empty((0,), dtype=dtype, device=torch.device("cuda", index))
    return tensor.set_(storage, desc.storage_offset, desc.shape, desc.stride)


def remove_orphaned_segment(path: str, owner_pid: int) -> bool:
    """Remove a kvcache /dev/shm file whose creator has exited; True if it was removed.

    Only files named by ``empty_shared`` are touched, and only when the owner pid is gone,
    so a live engine's cache (or anyone else's shared memory) is never removed.
    """
    name = os.path.basename(path)
    if os.path.dirname(path) != SHM_DIR or not name.startswith(SHM_PREFIX) or owner_pid <= 0:
        return False
    try:
        os.kill(owner_pid, 0)
        return False
    except ProcessLookupError:
        pass
    except PermissionError:
        return False  # a live process of another user
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


__all__ = [
    "ImportedTensor",
    "device_uuid",
    "dtype_from_name",
    "dtype_name",
    "empty_shared",
    "export_cpu_tensor",
    "export_cuda_tensor",
    "export_tensor",
    "flatten_kv_caches",
    "import_tensor",
    "record_ipc_event",
    "remove_orphaned_segment",
    "to_shared",
    "wait_ipc_event",
]
