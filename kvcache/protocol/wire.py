"""The wire's building blocks: the common Struct options, packed id arrays and tensor descriptors.

Separate from ``messages`` (which imports and re-exports every name here) so the message file
holds the requests and replies alone; these are the values messages carry, not operations.
NOTE: nothing here is ever pickled (see ``messages``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
MAX_DIMS = 16
"""Most dimensions a tensor descriptor names (every KV layout has at most six)."""
Dims = Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_DIMS)]


class Wire(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=False):
    """Common options: defaults stay off the wire, no GC tracking, unknown fields ignored."""


# -- tensor descriptors ------------------------------------------------------------------


class FdTensor(Wire, tag="fd", tag_field="via"):
    """A CPU tensor inside a sealed memfd that the engine handed to the daemon.

    The descriptors themselves never travel in a ZMQ frame: the client sends them beforehand
    over the daemon's Unix fd socket (``SCM_RIGHTS``) under a random ``Register.fd_ticket``;
    ``fd_index`` names one of the descriptors sent under that ticket. ``offset`` is the byte
    offset of element 0 inside the memfd; ``stride`` is in elements. No path is ever named,
    so a client cannot make the daemon open, map or delete a file of its choosing.
    """

    fd_index: NonNegInt
    offset: NonNegInt
    shape: Dims
    stride: Dims
    dtype: str


class CudaIpcTensor(Wire, tag="cuda_ipc", tag_field="via"):
    """A GPU tensor shared by CUDA IPC: the handle bytes plus typed fields, never a pickle.

    The fields mirror what ``torch.UntypedStorage._share_cuda_`` returns; ``device_uuid``
    replaces the ordinal because the two processes may number their GPUs differently.
    ``storage_offset`` and ``stride`` are in elements, like ``Tensor.as_strided``. torch's
    reference-counter file name and offset are not sent: the daemon never opens a
    shared-memory name a client chose (see ``kvcache.transport.cuda_ipc.NO_REF_COUNTER``).
    """

    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: NonNegInt
    storage_offset_bytes: NonNegInt
    event_handle: bytes
    event_sync_required: bool
    storage_offset: NonNegInt
    shape: Dims
    stride: Dims
    dtype: str


TensorDesc = FdTensor | CudaIpcTensor


class IdArray(Wire, array_like=True):
    """Integer ids (tokens, block ids) packed little-endian, ``width`` bytes each.

    ``width`` 4 is uint32 (every vocabulary and block table in practice), 8 is int64. A 1k-token
    prompt decodes in about a microsecond this way, against ~16 us as a MessagePack list of ints,
    and the engine hashes the bytes without building Python ints. Build one with
    ``kvcache.protocol.codec.pack_ids``.
    """

    data: bytes
    width: Literal[4, 8] = 4


__all__ = ["MAX_DIMS", "CudaIpcTensor", "Dims", "FdTensor", "IdArray", "NonNegInt", "TensorDesc", "Wire"]
