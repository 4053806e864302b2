"""GPU tensors shared through CUDA IPC handles: exported by the engine, opened and bounded by
the daemon.

GPU tensors travel as CUDA IPC handle bytes plus typed fields, mapped by device UUID (two
processes may number their GPUs differently). The daemon's side checks that the storage a
client describes fits the device allocation its handle maps, since a client chooses every
number in the descriptor. The events that order copies between the two processes are in
``cuda_events``: they travel with requests, not with the registration.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.protocol.messages import CudaIpcTensor
from kvcache.transfer.validate import cuda_errors
from kvcache.transport.descriptors import dtype_from_name, itemsize, shared_dtype_name, span_elements


def device_uuid(index: int) -> str:
    with cuda_errors(f"reading the UUID of GPU {index}"):
        return str(torch.cuda.get_device_properties(index).uuid)


# -- engine side -------------------------------------------------------------------------


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


# -- daemon side -------------------------------------------------------------------------


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


def import_cuda_tensor(desc: CudaIpcTensor) -> torch.Tensor:
    """Open one ``CudaIpcTensor`` on the GPU with its UUID, refusing a storage that does not
    fit the allocation its handle maps."""
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
    span = span_elements(desc.shape, desc.stride) * itemsize(dtype)
    if (desc.storage_offset * itemsize(dtype)) + span > desc.storage_size_bytes:
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


__all__ = ["NO_REF_COUNTER", "device_uuid", "export_cuda_tensor", "import_cuda_tensor"]
