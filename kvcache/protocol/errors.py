"""Translation between wire error codes and kvcache exceptions, both directions, in one place.

The daemon turns whatever a handler raises into an ``Error(code, message)`` reply; the client
turns that reply back into the same exception class, so a caller of ``KVCacheClient`` catches
``BlockIdError`` exactly as it would around an in-process ``CacheEngine``.
"""

from __future__ import annotations

from kvcache.errors import (
    AccessDeniedError,
    BlockIdError,
    ChunkMismatchError,
    CudaError,
    CudaUnavailableError,
    DeadlineExceededError,
    KvcacheError,
    LayoutError,
    LimitExceededError,
    ProtocolError,
    StorageError,
    UnknownInstanceError,
)
from kvcache.protocol.messages import Error, ErrorCode


class DaemonUnavailableError(KvcacheError, TimeoutError):
    """No reply from the daemon within the client's timeout (down, restarting or overloaded)."""


class RemoteError(KvcacheError, RuntimeError):
    """The daemon failed in a way no more specific class describes (``INTERNAL`` and the rest)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class ShuttingDownError(DaemonUnavailableError):
    """The daemon is stopping and refused new work; retry against its successor."""


_CODE_TO_CLASS: dict[ErrorCode, type[Exception]] = {
    ErrorCode.BAD_MESSAGE: ProtocolError,
    ErrorCode.VERSION_MISMATCH: ProtocolError,
    ErrorCode.TOO_LARGE: ProtocolError,
    ErrorCode.UNKNOWN_INSTANCE: UnknownInstanceError,
    ErrorCode.LAYOUT: LayoutError,
    ErrorCode.BLOCK_ID: BlockIdError,
    ErrorCode.CHUNK_MISMATCH: ChunkMismatchError,
    ErrorCode.STORAGE: StorageError,
    ErrorCode.CUDA_UNAVAILABLE: CudaUnavailableError,
    ErrorCode.CUDA: CudaError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.ACCESS_DENIED: AccessDeniedError,
    ErrorCode.LIMIT: LimitExceededError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}

# Most specific first: CorruptChunkError is a StorageError, UnknownInstanceError a KeyError,
# CudaUnavailableError a CudaError.
_CLASS_TO_CODE: list[tuple[type[BaseException], ErrorCode]] = [
    (UnknownInstanceError, ErrorCode.UNKNOWN_INSTANCE),
    (AccessDeniedError, ErrorCode.ACCESS_DENIED),
    (LimitExceededError, ErrorCode.LIMIT),
    (DeadlineExceededError, ErrorCode.DEADLINE_EXCEEDED),
    (BlockIdError, ErrorCode.BLOCK_ID),
    (LayoutError, ErrorCode.LAYOUT),
    (ChunkMismatchError, ErrorCode.CHUNK_MISMATCH),
    (StorageError, ErrorCode.STORAGE),
    (CudaUnavailableError, ErrorCode.CUDA_UNAVAILABLE),
    (CudaError, ErrorCode.CUDA),
    (ProtocolError, ErrorCode.BAD_MESSAGE),
    (ValueError, ErrorCode.BAD_REQUEST),
    (IndexError, ErrorCode.BAD_REQUEST),
    (TypeError, ErrorCode.BAD_REQUEST),
]


def error_from_exception(exc: BaseException) -> Error:
    """The reply for an exception a handler raised; unknown kinds become ``INTERNAL``."""
    for cls, code in _CLASS_TO_CODE:
        if isinstance(exc, cls):
            return Error(code=code, message=str(exc) or type(exc).__name__)
    return Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")


def exception_from_error(err: Error) -> Exception:
    """The exception a client raises for an ``Error`` reply."""
    cls = _CODE_TO_CLASS.get(err.code)
    if cls is None:
        return RemoteError(err.code, err.message)
    if cls is ShuttingDownError:
        return ShuttingDownError(err.message)
    return cls(err.message)


__all__ = [
    "DaemonUnavailableError",
    "RemoteError",
    "ShuttingDownError",
    "error_from_exception",
    "exception_from_error",
]
