"""CPU tensors shared through sealed memfds: allocated and exported by the engine, mapped by
the daemon.

CPU tensors live in memfds sealed against shrinking and growing; they travel as an index
into the descriptors handed over by ``fdpass`` plus shape, stride, dtype and byte offset, and
the daemon maps the same memory, so a store reads the engine's memory directly. The seal is
what keeps a buggy engine from truncating the memory under the daemon (SIGBUS). A CPU tensor
not in such a memfd cannot be shared: allocate the engine's KV cache with ``empty_shared``.

Both ends live here because export and import must agree byte for byte.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
from collections.abc import Sequence
from typing import Any

import torch

from kvcache.errors import LayoutError
from kvcache.protocol.messages import FdTensor
from kvcache.transport.descriptors import dtype_from_name, itemsize, shared_dtype_name, span_elements
from kvcache.transport.fdproto import ReceivedFds

MEMFD_PREFIX = "kvcache-"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


# -- engine side -------------------------------------------------------------------------


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
    flat = torch.frombuffer(segment, dtype=torch.uint8)[: numel * itemsize(dtype)]
    return flat.view(dtype).view(tuple(int(d) for d in shape))


def to_shared(kv_caches: Any) -> Any:
    """A copy of a CPU KV cache (tensor, list, or list of lists) in shared memory."""
    if isinstance(kv_caches, torch.Tensor):
        return empty_shared(kv_caches.shape, kv_caches.dtype).copy_(kv_caches)
    return [to_shared(x) for x in kv_caches]


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


# -- daemon side -------------------------------------------------------------------------


def import_fd_tensor(desc: FdTensor, received: ReceivedFds | None) -> torch.Tensor:
    """Map one ``FdTensor`` from the memfds ``received`` under its ticket."""
    if received is None or desc.fd_index >= len(received.fds):
        raise LayoutError(f"tensor names descriptor {desc.fd_index}, which was not handed over")
    dtype = dtype_from_name(desc.dtype)
    size_of = itemsize(dtype)
    span = span_elements(desc.shape, desc.stride) * size_of
    if span == 0:
        raise LayoutError("cannot map an empty KV tensor")
    if desc.offset % size_of:
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


__all__ = ["MEMFD_PREFIX", "empty_shared", "export_cpu_tensors", "import_fd_tensor", "to_shared"]
