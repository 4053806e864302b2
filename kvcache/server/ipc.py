"""Moving tensors between an engine process and the daemon without copying or pickling them.

Both ends live here because export and import must agree byte for byte: the engine side
(``empty_shared``, ``export_tensors``) and the daemon side (``import_tensor``). The CUDA
events that order copies between the two processes live in ``ipc_events`` (re-exported here):
they travel with requests, not with the registration, and share no code with the tensors.

CPU tensors live in memfds sealed against shrinking and growing; they travel as an index
into the descriptors handed over by ``fdpass`` plus shape, stride, dtype and byte offset, and
the daemon maps the same memory, so a store reads the engine's memory directly. The seal is
what keeps a buggy engine from truncating the memory under the daemon (SIGBUS). GPU tensors
travel as CUDA IPC handle bytes plus typed fields, mapped by device UUID (two processes may
number their GPUs differently). A CPU tensor not in such a memfd cannot be shared: allocate
the engine's KV cache with ``empty_shared``.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.protocol.messages import CudaIpcTensor, FdTensor, TensorDesc, TensorNesting
from kvcache.records import dtype_name
from kvcache.server.ipc_events import (  # re-exported: one import path for both halves
    EventKeeper,
    ExportedEvent,
    open_ipc_event,
    record_ipc_event,
    wait_ipc_event,
)
from kvcache.transfer.validate import cuda_errors

if TYPE_CHECKING:
    from kvcache.server.fdinbox import ReceivedFds

MEMFD_PREFIX = "kvcache-"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

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


# -- engine side: CPU ------------------------------------------------------------------


def empty_shared(shape: Sequence[int], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A zero-filled CPU tensor in a fresh sealed memfd that the daemon can map.

    The memfd can neither shrink nor grow (``F_SEAL_SHRINK | F_SEAL_GROW``, then
    ``F_SEAL_SEAL`` so no one can change that), so no process can pull the pages from under a
    mapping. It has no name in any file system: its memory goes when the last mapping and
    descriptor go, in whichever process that is; nothing is left behind if the engine dies.
    """
    numel = 1
    for dim in shape:
        numel *= int(dim)
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    fd = os.memfd_create(f"{MEMFD_PREFIX}{secrets.token_hex(8)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        segment = mmap.mmap(fd, nbytes)  # keeps its own duplicate of the descriptor
    finally:
        os.close(fd)
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


def _memfd_mappings() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, memfd name) of this process's kvcache memfd mappings."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith(f"/memfd:{MEMFD_PREFIX}"):
                continue
            start_s, end_s = parts[0].split("-")
            name = parts[5].rstrip("\n").removesuffix(" (deleted)")
            out.append((int(start_s, 16), int(end_s, 16), int(parts[2], 16), name))
    return out


def _memfd_descriptors() -> dict[str, int]:
    """memfd name -> an open descriptor of it in this process (the one each mmap keeps).

    Read from /proc rather than a table kept here: the mapping itself is the one record of
    which memfd a tensor lives in, and it cannot go stale."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{MEMFD_PREFIX}"):
            out.setdefault(target.removesuffix(" (deleted)"), int(entry))
    return out


def export_cpu_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[FdTensor], list[int]]:
    """Descriptors for CPU tensors made by ``empty_shared``, and the distinct memfds they use
    (``FdTensor.fd_index`` points into that list). The descriptors stay this process's: the
    hand-over duplicates them into the daemon."""
    mappings = _memfd_mappings()
    fds_by_name = _memfd_descriptors()
    descs: list[FdTensor] = []
    fds: list[int] = []
    index: dict[str, int] = {}
    for tensor in tensors:
        if tensor.numel() == 0:
            raise LayoutError("cannot share an empty KV tensor")
        address = tensor.data_ptr()
        found = next(
            ((off + address - lo, name) for lo, hi, off, name in mappings if lo <= address < hi), None
        )
        if found is None or found[1] not in fds_by_name:
            raise LayoutError(
                "CPU KV tensors must live in a kvcache memfd for the daemon to map them; "
                "allocate them with kvcache.client.empty_shared(shape, dtype)"
            )
        offset, name = found
        if name not in index:
            index[name] = len(fds)
            fds.append(fds_by_name[name])
        descs.append(
            FdTensor(
                fd_index=index[name],
                offset=offset,
                shape=list(tensor.shape),
                stride=list(tensor.stride()),
                dtype=shared_dtype_name(tensor.dtype),
            )
        )
    return descs, fds


# -- engine side: CUDA -----------------------------------------------------------------


def device_uuid(index: int) -> str:
    with cuda_errors(f"reading the UUID of GPU {index}"):
        return str(torch.cuda.get_device_properties(index).uuid)


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIpcTensor:
    storage = tensor.untyped_storage()
    with cuda_errors("exporting a KV tensor as a CUDA IPC handle"):
        (device, handle, size_bytes, offset_bytes, _, _, ev_handle, ev_sync) = storage._share_cuda_()
    return CudaIpcTensor(
        device_uuid=device_uuid(int(device)),
        ipc_handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        event_handle=bytes(ev_handle) if ev_handle else b"",
        event_sync_required=bool(ev_sync),
        storage_offset=int(tensor.storage_offset()),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        dtype=shared_dtype_name(tensor.dtype),
    )


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
        return ImportedTensor(_import_fd(desc, received))
    return ImportedTensor(_import_cuda(desc))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    if len(shape) != len(stride):
        raise LayoutError(f"shape {list(shape)} and stride {list(stride)} differ in rank")
    if any(d == 0 for d in shape):
        return 0
    return sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1


def descriptor_bytes(desc: TensorDesc) -> int:
    """Bytes a descriptor's view spans, from its shape and strides (before mapping anything)."""
    return _span_elements(desc.shape, desc.stride) * _itemsize(dtype_from_name(desc.dtype))


def _import_fd(desc: FdTensor, received: ReceivedFds | None) -> torch.Tensor:
    if received is None or desc.fd_index >= len(received.fds):
        raise LayoutError(f"tensor names descriptor {desc.fd_index}, which was not handed over")
    dtype = dtype_from_name(desc.dtype)
    itemsize = _itemsize(dtype)
    span = _span_elements(desc.shape, desc.stride) * itemsize
    if span == 0:
        raise LayoutError("cannot map an empty KV tensor")
    if desc.offset % itemsize:
        raise LayoutError(f"offset {desc.offset} is not aligned to {desc.dtype}")
    size = received.sizes[desc.fd_index]  # sealed: it cannot shrink after this was read
    if desc.offset + span > size:
        raise LayoutError(
            f"tensor needs bytes [{desc.offset}, {desc.offset + span}) of a memfd of {size} bytes"
        )
    # Map only the pages this view spans: many tensors often share one large memfd.
    start = desc.offset - desc.offset % mmap.ALLOCATIONGRANULARITY
    try:
        segment = mmap.mmap(received.fds[desc.fd_index], desc.offset + span - start,
                            mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)  # fmt: skip
    except (OSError, ValueError) as exc:  # e.g. write-sealed or read-only memory
        raise LayoutError(f"cannot map the engine's memfd read-write: {exc}") from None
    flat = torch.frombuffer(segment, dtype=torch.uint8)[desc.offset - start : desc.offset - start + span]
    return flat.view(dtype).as_strided(desc.shape, desc.stride)


def _cuda_device_for_uuid(uuid: str) -> int:
    if not torch.cuda.is_available():
        raise CudaUnavailableError("the engine shared CUDA tensors but the daemon sees no GPU")
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise CudaUnavailableError(f"no GPU with UUID {uuid} is visible to the daemon")


NO_REF_COUNTER = b"/kvcache/no-ref-counter"
"""What the daemon gives torch as the producer's reference-counter file. torch opens that
shared-memory name when the mapping is released and decrements an int64 at an offset in it;
from a client, name and offset would let any engine make the daemon write into any shm file
(or past its end). ``shm_open`` refuses a name with an inner slash, so the decrement finds
nothing and torch skips it: the engine's memory stays mapped until the engine exits, which is
what a registered KV cache does anyway."""


def _import_cuda(desc: CudaIpcTensor) -> torch.Tensor:
    index = _cuda_device_for_uuid(desc.device_uuid)
    dtype = dtype_from_name(desc.dtype)
    if desc.event_sync_required and not desc.event_handle:
        raise LayoutError("the engine asks the daemon to wait on an event but sent no event handle")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            desc.ipc_handle,
            desc.storage_size_bytes,
            desc.storage_offset_bytes,
            NO_REF_COUNTER,
            0,
            desc.event_handle,
            desc.event_sync_required,
        )
    except RuntimeError as exc:  # a handle that names no memory of this GPU, say
        raise LayoutError(f"cannot open the engine's CUDA IPC handle: {exc}") from None
    # torch maps the handle's allocation and adds storage_offset_bytes to its start: the
    # storage must end inside that allocation, not merely inside whichever one it lands in.
    handle_base = storage.data_ptr() - desc.storage_offset_bytes
    if handle_base <= 0:
        raise LayoutError("the CUDA IPC handle maps no device memory")
    _check_within_allocation(index, handle_base, desc.storage_offset_bytes + desc.storage_size_bytes)
    span = _span_elements(desc.shape, desc.stride) * _itemsize(dtype)
    if (desc.storage_offset * _itemsize(dtype)) + span > desc.storage_size_bytes:
        raise LayoutError(
            f"tensor needs {span} bytes at element {desc.storage_offset} of a "
            f"{desc.storage_size_bytes}-byte storage"
        )
    tensor = torch.empty((0,), dtype=dtype, device=torch.device("cuda", index))
    return tensor.set_(storage, desc.storage_offset, desc.shape, desc.stride)


def _check_within_allocation(index: int, address: int, nbytes: int) -> None:
    """Refuse a storage that does not fit the device allocation its handle maps: ``address``
    is where the handle's memory starts in the daemon, ``nbytes`` the client's offset plus
    storage size. Copies past that allocation would fault the daemon's context (every engine
    loses its service) or, with an offset aimed at the next mapping, read and write another
    engine's KV. The allocation is looked up at ``address`` itself, never at the offset
    address: that one may lie in any allocation the daemon has mapped."""
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    with cuda_errors("asking the CUDA driver for the IPC storage's allocation"), torch.cuda.device(index):
        result = _driver().cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)
        )
    if result != 0:
        raise LayoutError(f"the CUDA IPC storage is not device memory (driver error {result})")
    if address + nbytes > base.value + size.value:
        raise LayoutError(
            f"the storage claims {nbytes} bytes (its offset included) but the allocation its "
            f"handle maps ends {base.value + size.value - address} bytes after its start"
        )


def _driver() -> Any:
    """The CUDA driver library torch already loaded (the runtime API has no address-range call)."""
    return ctypes.CDLL("libcuda.so.1")


__all__ = [
    "EventKeeper",
    "ExportedEvent",
    "ImportedTensor",
    "descriptor_bytes",
    "device_uuid",
    "dtype_from_name",
    "empty_shared",
    "export_cpu_tensors",
    "export_cuda_tensor",
    "export_tensors",
    "flatten_kv_caches",
    "import_tensor",
    "open_ipc_event",
    "record_ipc_event",
    "shared_dtype_name",
    "to_shared",
    "wait_ipc_event",
]
