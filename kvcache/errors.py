"""Every exception kvcache raises, in one tree, each with the wire code the daemon answers with.

Each error also derives from the matching builtin, so callers that already catch
``IndexError`` or ``ValueError`` keep working::

    KvcacheError                          (INTERNAL unless a class below says otherwise)
    ├── LayoutError (ValueError)          unknown or ambiguous KV layout, bad registration
    ├── BlockIdError (IndexError)         a block id outside [0, num_blocks)
    ├── ChunkMismatchError (ValueError)   chunk tensors that do not fit the registered cache
    ├── CudaError (RuntimeError)          the CUDA runtime or driver failed (a device fault, no memory)
    │   └── CudaUnavailableError          a CUDA path on a build or machine without CUDA
    ├── StorageError (RuntimeError)       a tier failed (disk, Redis); translated at the adapter edge
    │   └── CorruptChunkError             a stored chunk failed its header or checksum check
    │       └── ChecksumMismatchError     its bytes do not match its checksum (record or tier metadata)
    ├── UnknownInstanceError (KeyError)   a request names an instance that never registered
    ├── AccessDeniedError (PermissionError)  a wrong registration token, an unknown peer, a tenant limit
    │   └── UntrustedPathError            a directory, file or socket another user could have planted
    ├── LimitExceededError (ValueError)   a configured bound (tensors, ids, instances) was hit
    ├── DeadlineExceededError (TimeoutError)  the caller's deadline passed before a copy began
    ├── TransferError (RuntimeError)      a copy job failed on the device, or its handler is closed
    ├── UnknownTransferError (KeyError)   a job id its handler never issued or already reported
    ├── ProtocolError (ValueError)        a daemon message that cannot be decoded or is of another version
    ├── ConfigError (ValueError)          a configuration value out of range or inconsistent
    │   └── RedisURLError                 a malformed or unsupported Redis URL
    ├── TracingUnavailableError (RuntimeError)  tracing asked for without the OpenTelemetry SDK
    ├── DaemonStartError (RuntimeError)   a daemon child process died or stayed silent before ready
    ├── DaemonUnavailableError (TimeoutError)  no reply from the daemon in time
    │   └── ShuttingDownError             the daemon refused new work because it is stopping
    ├── RemoteError (RuntimeError)        the daemon failed in a way no class above describes
    └── ProxyError                        the disaggregation proxy answers a client with an error
        ├── ProxyRequestError (ValueError)  a client request refused before any upstream call (400)
        └── UpstreamError (RuntimeError)  an upstream call gave no answer to relay as a success

The wire code is a class attribute, ``wire_code``, inherited like any other: a new subclass
answers with its parent's code unless it names its own. ``kvcache.protocol.errors`` derives
both directions of the daemon's mapping from these attributes, so there is no second table to
keep in step. This module imports nothing from kvcache, so every other module may import it.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(str, enum.Enum):
    """Why a request failed, as the daemon's ``Error`` reply names it.

    Here rather than in ``kvcache.protocol.messages`` (which re-exports it) because every
    exception class below carries one; the protocol imports this module, never the reverse.
    """

    BAD_MESSAGE = "bad_message"  # undecodable, truncated, wrong frame count, schema violation
    VERSION_MISMATCH = "version_mismatch"
    TOO_LARGE = "too_large"
    UNKNOWN_INSTANCE = "unknown_instance"
    LAYOUT = "layout"  # tensors match no KV layout, or cannot be mapped
    BLOCK_ID = "block_id"
    CHUNK_MISMATCH = "chunk_mismatch"
    STORAGE = "storage"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    CUDA = "cuda"  # the daemon's CUDA runtime or driver failed (device fault, out of memory, a handle)
    BAD_REQUEST = "bad_request"  # well-formed but invalid arguments
    SHUTTING_DOWN = "shutting_down"
    ACCESS_DENIED = "access_denied"  # wrong or missing registration token, tenant restriction
    LIMIT = "limit"  # a per-registration or per-request bound was hit
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the client's deadline passed before the copy began
    INTERNAL = "internal"


class KvcacheError(Exception):
    """Root of every error kvcache raises."""

    wire_code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    """The code the daemon answers with when a handler raises this class. A class that names
    its own code (in its body) is also the one a client raises for that code, unless the code
    is a generic one (``BAD_REQUEST``, ``INTERNAL``) that several unrelated errors share."""
    wire_aliases: ClassVar[tuple[ErrorCode, ...]] = ()
    """Further codes a client raises this class for (the daemon's codec sends them itself)."""


class LayoutError(KvcacheError, ValueError):
    """The KV tensors do not match any known layout, or match more than one."""

    wire_code = ErrorCode.LAYOUT


class BlockIdError(KvcacheError, IndexError):
    """A block id lies outside ``[0, num_blocks)``; nothing was copied."""

    wire_code = ErrorCode.BLOCK_ID


class ChunkMismatchError(KvcacheError, ValueError):
    """Chunk tensors disagree with the registered cache (shape, dtype, device, count)."""

    wire_code = ErrorCode.CHUNK_MISMATCH


class CudaError(KvcacheError, RuntimeError):
    """The CUDA runtime or driver failed: a device fault, out of device memory, a handle it
    could not open. Raised from torch's and the native module's errors at one edge
    (``kvcache.transfer.validate.cuda_error``), so callers never see a bare RuntimeError."""

    wire_code = ErrorCode.CUDA


class CudaUnavailableError(CudaError):
    """A CUDA path was asked for on a build or machine without CUDA."""

    wire_code = ErrorCode.CUDA_UNAVAILABLE


class StorageError(KvcacheError, RuntimeError):
    """A storage tier failed; the engine treats it as a miss and counts it."""

    wire_code = ErrorCode.STORAGE


class CorruptChunkError(StorageError):
    """A stored chunk failed validation (header, size or checksum) and was discarded."""


class ForgedRecordError(CorruptChunkError):
    """A Redis L2 record is not sealed with this daemon's key (``--l2-redis-auth-key-file``):
    written by someone else who can write to the Redis, altered, or moved under another key.
    It was refused (a miss) and deleted, never served."""


class ChecksumMismatchError(CorruptChunkError):
    """A stored chunk's bytes do not match its checksum (the record's, or the one the tier's
    metadata keeps): a miss, counted in ``kvcache_l2_checksum_failures_total``, never served."""


class UnknownInstanceError(KvcacheError, KeyError):
    """A request named an engine instance that is not registered."""

    wire_code = ErrorCode.UNKNOWN_INSTANCE

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown instance"


class AccessDeniedError(KvcacheError, PermissionError):
    """The caller may not do this: it lacks the instance's registration token, its peer
    credentials are not allowed, or its tenant is restricted to other models or salts."""

    wire_code = ErrorCode.ACCESS_DENIED


class UntrustedPathError(AccessDeniedError):
    """A directory, file or socket kvcache was pointed at could have been planted by another
    user: a symlink, the wrong owner, a group- or world-accessible mode, or a socket served by
    another uid. Nothing was read from it or handed to it; the message says how to fix it."""


class LimitExceededError(KvcacheError, ValueError):
    """A request exceeds a configured bound (tensors per registration, ids per request,
    registered instances, descriptors); nothing was changed."""

    wire_code = ErrorCode.LIMIT


class PrincipalLimitError(LimitExceededError):
    """One principal (a tenant) is at a per-principal bound of the daemon (``server.budget``):
    its request was refused at once, nothing changed, and other principals are unaffected. It
    travels as ``LIMIT``; the client should back off and retry. ``flag`` names the bound."""

    def __init__(self, message: str, flag: str = "") -> None:
        super().__init__(message)
        self.flag = flag


class DeadlineExceededError(KvcacheError, TimeoutError):
    """The request's deadline passed before its copy could start; no byte was moved."""

    wire_code = ErrorCode.DEADLINE_EXCEEDED


class TransferError(KvcacheError, RuntimeError):
    """A copy job failed while it ran (a device fault), or was submitted to a closed handler."""


class UnknownTransferError(KvcacheError, KeyError):
    """A job id the transfer handler never issued, or whose result was already handed out."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown transfer job"


class ProtocolError(KvcacheError, ValueError):
    """A wire message could not be decoded, or speaks another protocol version."""

    wire_code = ErrorCode.BAD_MESSAGE
    wire_aliases = (ErrorCode.VERSION_MISMATCH, ErrorCode.TOO_LARGE)


class ConfigError(KvcacheError, ValueError):
    """A configuration value is out of range or inconsistent; the message names the field."""

    wire_code = ErrorCode.BAD_REQUEST


class RedisURLError(ConfigError):
    """A Redis URL is malformed or asks for something kvcache does not support; the message
    says which part and shows the URL with any password hidden."""


class TracingUnavailableError(KvcacheError, RuntimeError):
    """Tracing was asked for but the OpenTelemetry SDK or exporter is not installed."""


class DaemonStartError(KvcacheError, RuntimeError):
    """The daemon exited or stayed silent before logging its ready line."""


class DaemonUnavailableError(KvcacheError, TimeoutError):
    """No reply from the daemon within the client's timeout (down, restarting or overloaded)."""


class ShuttingDownError(DaemonUnavailableError):
    """The daemon is stopping and refused new work; retry against its successor."""

    wire_code = ErrorCode.SHUTTING_DOWN


class RemoteError(KvcacheError, RuntimeError):
    """The daemon failed in a way no more specific class describes (``INTERNAL`` and the rest).

    ``code`` is the code the daemon sent; ``wire_code`` stays ``INTERNAL``, as for any error
    without a code of its own."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class ProxyError(KvcacheError):
    """The disaggregation proxy (``kvcache.integrations.vllm.proxy``) answers a client's request
    with an error instead of relaying an instance's answer; ``status`` is the HTTP status the
    client gets. Never sent on the daemon's wire."""

    status: int = 502


class ProxyRequestError(ProxyError, ValueError):
    """A client request the proxy refuses before calling any instance (answered with 400)."""

    wire_code = ErrorCode.BAD_REQUEST
    status = 400


class UpstreamError(ProxyError, RuntimeError):
    """An upstream (prefill or decode) call that produced no answer to relay as a success.

    Carries the answer the client gets instead: ``status``, ``body`` and ``headers``, either
    the instance's own error answer passed through or the proxy's own (502 for an instance that
    failed or could not be reached, 504 for one that stayed silent past its timeout). Plain
    data, so this module needs no HTTP library; the proxy turns it into its response."""

    def __init__(
        self, message: str, status: int = 502, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


__all__ = [
    "AccessDeniedError",
    "BlockIdError",
    "ChecksumMismatchError",
    "ChunkMismatchError",
    "ConfigError",
    "CorruptChunkError",
    "CudaError",
    "CudaUnavailableError",
    "DaemonStartError",
    "DaemonUnavailableError",
    "DeadlineExceededError",
    "ErrorCode",
    "ForgedRecordError",
    "KvcacheError",
    "LayoutError",
    "LimitExceededError",
    "PrincipalLimitError",
    "ProtocolError",
    "ProxyError",
    "ProxyRequestError",
    "RedisURLError",
    "RemoteError",
    "ShuttingDownError",
    "StorageError",
    "TracingUnavailableError",
    "TransferError",
    "UnknownInstanceError",
    "UnknownTransferError",
    "UntrustedPathError",
    "UpstreamError",
]
