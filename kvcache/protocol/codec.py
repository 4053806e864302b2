"""Bytes <-> envelopes for the daemon protocol, with the checks a hostile frame needs.

Separate from ``messages`` so that the Structs stay a pure vocabulary; every size, version
and decode check lives here and is fuzzed by the tests. Encoders and decoders are built once
(msgspec's are reusable and thread-safe).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from kvcache.ids import unpacked
from kvcache.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    IdArray,
    ReplyBody,
    ReplyEnvelope,
    RequestBody,
    RequestEnvelope,
    RequestHeader,
)

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(RequestEnvelope)
_HEADER_DECODER = msgspec.msgpack.Decoder(RequestHeader)
_REPLY_DECODER = msgspec.msgpack.Decoder(ReplyEnvelope)


class DecodeFailure(Exception):
    """A request frame the daemon cannot serve; carries the reply to send instead.

    ``request_id`` is recovered from the header when possible so the client can match it.
    """

    def __init__(self, error: Error, request_id: int = 0) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


def encode_request(request_id: int, body: RequestBody, version: int = PROTOCOL_VERSION) -> bytes:
    return _ENCODER.encode(RequestEnvelope(v=version, id=request_id, body=body))


def encode_reply(request_id: int, body: ReplyBody) -> bytes:
    return _ENCODER.encode(ReplyEnvelope(v=PROTOCOL_VERSION, id=request_id, body=body))


def decode_request(
    frame: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> RequestEnvelope:
    """Decode one request frame or raise ``DecodeFailure`` holding the error reply.

    The version is checked before the schema so that a peer of another version learns
    that, and not some field-level complaint caused by the version change.
    """
    if len(frame) > max_bytes:
        raise DecodeFailure(
            Error(
                code=ErrorCode.TOO_LARGE,
                message=f"request of {len(frame)} bytes exceeds the limit of {max_bytes}",
            )
        )
    try:
        envelope = _REQUEST_DECODER.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        header = _try_header(frame)
        if header is not None and header.v != PROTOCOL_VERSION:
            raise DecodeFailure(_version_error(header.v), header.id) from None
        request_id = header.id if header is not None else 0
        raise DecodeFailure(
            Error(code=ErrorCode.BAD_MESSAGE, message=f"cannot decode request: {exc}"),
            request_id,
        ) from None
    if envelope.v != PROTOCOL_VERSION:
        raise DecodeFailure(_version_error(envelope.v), envelope.id)
    return envelope


def decode_reply(frame: bytes | memoryview) -> ReplyEnvelope:
    """Decode a reply; raises ``msgspec.DecodeError`` on garbage (the client treats it as fatal)."""
    return _REPLY_DECODER.decode(frame)


def pack_ids(ids: Sequence[int] | Any) -> IdArray:
    """Pack a list, tuple, numpy array or CPU tensor of ints (uint32 when they all fit)."""
    if isinstance(ids, np.ndarray) or hasattr(ids, "numpy"):
        arr = np.asarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids).reshape(-1)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) < 1 << 32):
            return IdArray(np.ascontiguousarray(arr, dtype="<u4").tobytes(), 4)
        return IdArray(np.ascontiguousarray(arr, dtype="<i8").tobytes(), 8)
    seq = ids if isinstance(ids, (list, tuple)) else list(ids)
    width: Literal[4, 8] = 4
    try:
        packed = array.array("I", seq)
    except OverflowError:  # a negative id or one past 2**32
        packed, width = array.array("q", seq), 8
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return IdArray(packed.tobytes(), width)


def unpack_ids(ids: IdArray) -> np.ndarray:
    """The ids as a read-only numpy array (no copy); ``ValueError`` on a ragged buffer.
    (``ids.unpacked``: the request builder unpacks the wire's ids itself.)"""
    return np.asarray(unpacked(ids))


def _try_header(frame: bytes | memoryview) -> RequestHeader | None:
    try:
        header = _HEADER_DECODER.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    # An id outside int64 cannot be echoed back in a reply; drop it rather than fail again.
    if not -(1 << 63) <= header.id < (1 << 63):
        header = RequestHeader(v=header.v)
    return header


def _version_error(version: int) -> Error:
    return Error(
        code=ErrorCode.VERSION_MISMATCH,
        message=(
            f"client speaks kvcache protocol v{version}, this daemon speaks "
            f"v{PROTOCOL_VERSION}; install matching kvcache versions on both sides"
        ),
    )


__all__ = [
    "DecodeFailure",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "pack_ids",
    "unpack_ids",
]
