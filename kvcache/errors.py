"""Every exception kvcache raises, in one tree.

Each error also derives from the matching builtin, so callers that already catch
``IndexError`` or ``ValueError`` keep working::

    KvcacheError
    ├── LayoutError (ValueError)          unknown or ambiguous KV layout, bad registration
    ├── BlockIdError (IndexError)         a block id outside [0, num_blocks)
    ├── ChunkMismatchError (ValueError)   chunk tensors that do not fit the registered cache
    ├── CudaError (RuntimeError)          the CUDA runtime or driver failed (a device fault, no memory)
    │   └── CudaUnavailableError          a CUDA path on a build or machine without CUDA
    ├── StorageError (RuntimeError)       a tier failed (disk, Redis); translated at the adapter edge
    │   └── CorruptChunkError             a stored chunk failed its header or checksum check
    ├── UnknownInstanceError (KeyError)   a request names an instance that never registered
    ├── AccessDeniedError (PermissionError)  a wrong registration token, an unknown peer, a tenant limit
    │   └── UntrustedPathError            a directory, file or socket another user could have planted
    ├── LimitExceededError (ValueError)   a configured bound (tensors, ids, instances) was hit
    ├── DeadlineExceededError (TimeoutError)  the caller's deadline passed before a copy began
    ├── TransferError (RuntimeError)      a copy job failed on the device, or its handler is closed
    ├── UnknownTransferError (KeyError)   a job id its handler never issued or already reported
    └── ProtocolError (ValueError)        a daemon message that cannot be decoded or is of another version
"""

from __future__ import annotations


class KvcacheError(Exception):
    """Root of every error kvcache raises."""


class LayoutError(KvcacheError, ValueError):
    """The KV tensors do not match any known layout, or match more than one."""


class BlockIdError(KvcacheError, IndexError):
    """A block id lies outside ``[0, num_blocks)``; nothing was copied."""


class ChunkMismatchError(KvcacheError, ValueError):
    """Chunk tensors disagree with the registered cache (shape, dtype, device, count)."""


class CudaError(KvcacheError, RuntimeError):
    """The CUDA runtime or driver failed: a device fault, out of device memory, a handle it
    could not open. Raised from torch's and the native module's errors at one edge
    (``kvcache.transfer.validate.cuda_error``), so callers never see a bare RuntimeError."""


class CudaUnavailableError(CudaError):
    """A CUDA path was asked for on a build or machine without CUDA."""


class StorageError(KvcacheError, RuntimeError):
    """A storage tier failed; the engine treats it as a miss and counts it."""


class CorruptChunkError(StorageError):
    """A stored chunk failed validation (header, size or checksum) and was discarded."""


class UnknownInstanceError(KvcacheError, KeyError):
    """A request named an engine instance that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown instance"


class AccessDeniedError(KvcacheError, PermissionError):
    """The caller may not do this: it lacks the instance's registration token, its peer
    credentials are not allowed, or its tenant is restricted to other models or salts."""


class UntrustedPathError(AccessDeniedError):
    """A directory, file or socket kvcache was pointed at could have been planted by another
    user: a symlink, the wrong owner, a group- or world-accessible mode, or a socket served by
    another uid. Nothing was read from it or handed to it; the message says how to fix it."""


class LimitExceededError(KvcacheError, ValueError):
    """A request exceeds a configured bound (tensors per registration, ids per request,
    registered instances, descriptors); nothing was changed."""


class DeadlineExceededError(KvcacheError, TimeoutError):
    """The request's deadline passed before its copy could start; no byte was moved."""


class TransferError(KvcacheError, RuntimeError):
    """A copy job failed while it ran (a device fault), or was submitted to a closed handler."""


class UnknownTransferError(KvcacheError, KeyError):
    """A job id the transfer handler never issued, or whose result was already handed out."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown transfer job"


class ProtocolError(KvcacheError, ValueError):
    """A wire message could not be decoded, or speaks another protocol version."""


__all__ = [
    "AccessDeniedError",
    "BlockIdError",
    "ChunkMismatchError",
    "CorruptChunkError",
    "CudaError",
    "CudaUnavailableError",
    "DeadlineExceededError",
    "KvcacheError",
    "LayoutError",
    "LimitExceededError",
    "ProtocolError",
    "StorageError",
    "TransferError",
    "UnknownInstanceError",
    "UnknownTransferError",
    "UntrustedPathError",
]
