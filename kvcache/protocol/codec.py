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

from kvcache.errors import LimitExceededError
from kvcache.ids import unpacked
from kvcache.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    IdArray,
    LookupItem,
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


def decode_request(frame: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> RequestEnvelope:
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


def with_heads(items: Sequence[LookupItem], chunk_tokens: int) -> list[LookupItem]:
    """``items`` with the leading whole chunks (of ``chunk_tokens`` ids) each shares with the
    item before left out and counted in ``head``: the daemon adds them back, so a step's
    prompts that share a system prompt carry it once. Only 32-bit ids (a vocabulary's) are
    compared; an item that already has a head is kept as it is, and the next one gets none."""
    out: list[LookupItem] = []
    step = 4 * chunk_tokens
    prior = b""  # the item before's ids, whole
    for item in items:
        ids = item.token_ids
        whole = min(len(ids.data), len(prior)) // step if step and ids.width == 4 else 0
        lo, hi = 0, whole + 1  # the first lo chunks are shared, the first hi are not
        view = memoryview(prior)
        while hi - lo > 1:  # a bisection of prefix compares, each one memcmp without a copy
            mid = (lo + hi) // 2
            if ids.data.startswith(view[: mid * step]):
                lo = mid
            else:
                hi = mid
        head = lo * step
        if head and not item.head:
            out.append(msgspec.structs.replace(item, token_ids=IdArray(ids.data[head:], 4), head=head // 4))
        else:
            out.append(item)
        prior = ids.data if ids.width == 4 and not item.head else b""
    return out


def whole_ids(items: Sequence[LookupItem], max_added: int | None) -> list[IdArray]:
    """Each item's ids with its head added back (``with_heads`` undone), every check first:
    ``ValueError`` for a head the batch does not back (on the first item, past the ids of the
    item before, or of another width) and ``LimitExceededError`` when the heads would add back
    more than ``max_added`` ids in all (the daemon's ``--max-ids``): a few bytes of heads may
    not make the daemon build and hash more than one longest request beyond what was sent."""
    added = count = width = 0  # count, width: the item before's, whole
    for i, item in enumerate(items):
        ids = item.token_ids
        if item.head:
            if i == 0:
                raise ValueError(f"the first item of a batch has a head ({item.head} ids) but no item before")
            if ids.width != width:
                raise ValueError(f"item {i} has a head of {ids.width}-byte ids after {width}-byte ids")
            if item.head > count:
                raise ValueError(f"item {i} has a head of {item.head} ids; the item before holds {count}")
            added += item.head
        count, width = item.head + len(ids.data) // ids.width, ids.width
    if max_added is not None and added > max_added:
        raise LimitExceededError(
            f"the heads of one batch add back {added} ids; the limit is {max_added} (--max-ids)"
        )
    out: list[IdArray] = []
    before = b""
    for item in items:
        ids = item.token_ids
        if item.head:
            ids = IdArray(before[: item.head * ids.width] + ids.data, ids.width)
        out.append(ids)
        before = ids.data
    return out


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
