"""The on-tier chunk record: a self-describing header followed by the raw chunk bytes.

Shared by every L2 tier so a chunk read back from disk or Redis is checked the same way: the
header names the key, dtype and shape and carries a CRC32 of the payload, so a truncated,
corrupted, misplaced or foreign record is detected before a byte reaches the engine's cache.
CRC32 (``zlib``, ~6 GB/s here, releases the GIL) is for accidents, not attacks: tiers are trusted
storage; xxhash is not a dependency.

Layout (little-endian)::

    magic "KVC\\x01" | version u16 | header_len u16 | key u128 | dtype 16s (ascii, NUL-padded)
    | ndim u8 | shape ndim x u64 | nbytes u64 | crc32 u32
    | [version 2 only: meta_len u32 | meta_crc32 u32 | meta (meta_len bytes)]
    | payload (nbytes bytes)

``header_len`` is the size of the fixed part (up to and including ``meta_crc32``). Version 2
adds ``meta``: what the tier keeps about the chunk besides its bytes (the disk tier: how KV
events announced it, ``ChunkIdentity``), with its own CRC. A record without meta is still
written as version 1, byte for byte what older builds write and read (they share Redis).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from kvcache.errors import ChecksumMismatchError, CorruptChunkError
from kvcache.records import ChunkKey, dtype_name

MAGIC = b"KVC\x01"
FORMAT_VERSION = 2
"""The newest record version this build writes (for records with meta) and reads (1 and 2)."""
_FIXED = struct.Struct("<4sHHQQ16sB")  # magic, version, header_len, key lo, key hi, dtype, ndim
_TAIL = struct.Struct("<QI")  # nbytes, crc32
_META = struct.Struct("<II")  # version 2: meta_len, meta crc32
MAX_HEADER = _FIXED.size + 8 * 8 + _TAIL.size + _META.size
"""The largest fixed part: reading this many bytes is enough to find the payload."""
_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: ChunkKey
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    header_len: int
    """Offset of the payload: the fixed part plus the meta."""
    meta_offset: int = 0
    """Offset of the meta (``header_len`` when there is none)."""
    meta_crc32: int = 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 and fp8 included)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("chunk must be a contiguous CPU tensor")
    return t.view(torch.uint8).reshape(-1).numpy().data


def encode_header(key: ChunkKey, chunk: torch.Tensor, payload: memoryview, meta: bytes = b"") -> bytes:
    """Everything before the payload: the fixed part, then ``meta`` (version 2) if any."""
    shape = tuple(chunk.shape)
    if len(shape) > 8:
        raise ValueError("chunk rank above 8")
    fixed_len = _FIXED.size + 8 * len(shape) + _TAIL.size + (_META.size if meta else 0)
    parts = [
        _FIXED.pack(
            MAGIC,
            2 if meta else 1,
            fixed_len,
            key & _M64,
            key >> 64,
            dtype_name(chunk.dtype).encode("ascii"),
            len(shape),
        ),
        struct.pack(f"<{len(shape)}Q", *shape),
        _TAIL.pack(len(payload), zlib.crc32(payload)),
    ]
    if meta:
        parts += [_META.pack(len(meta), zlib.crc32(meta)), meta]
    return b"".join(parts)


def decode_header(buf: bytes | memoryview) -> ChunkHeader:
    """Parse the fixed part at the start of ``buf`` (the meta need not be there yet);
    raises ``CorruptChunkError`` when malformed."""
    if len(buf) < _FIXED.size:
        raise CorruptChunkError(f"record of {len(buf)} bytes is shorter than a header")
    magic, version, header_len, lo, hi, dt, ndim = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {magic!r}")
    if version not in (1, 2):
        raise CorruptChunkError(f"record format version {version}, this build reads 1 to {FORMAT_VERSION}")
    meta_fields = _META.size if version == 2 else 0
    if ndim > 8 or header_len != _FIXED.size + 8 * ndim + _TAIL.size + meta_fields or len(buf) < header_len:
        raise CorruptChunkError("truncated or inconsistent header")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    nbytes, crc = _TAIL.unpack_from(buf, _FIXED.size + 8 * ndim)
    meta_len = meta_crc = 0
    if version == 2:
        meta_len, meta_crc = _META.unpack_from(buf, header_len - _META.size)
    return ChunkHeader(
        key=lo | (hi << 64),
        dtype=dt.rstrip(b"\0").decode("ascii", "replace"),
        shape=tuple(shape),
        nbytes=nbytes,
        crc32=crc,
        header_len=header_len + meta_len,
        meta_offset=header_len,
        meta_crc32=meta_crc,
    )


def decode_meta(buf: bytes | memoryview, header: ChunkHeader) -> bytes:
    """The record's meta (``b""`` for version 1); ``buf`` must reach the payload."""
    if header.meta_offset == header.header_len:
        return b""
    if len(buf) < header.header_len:
        raise CorruptChunkError("record ends inside its meta")
    meta = bytes(buf[header.meta_offset : header.header_len])
    if zlib.crc32(meta) != header.meta_crc32:
        raise CorruptChunkError("meta checksum mismatch")
    return meta


def check_fits(header: ChunkHeader, key: ChunkKey, out: torch.Tensor) -> None:
    """The record must be the chunk ``out`` expects, under the key it was asked for."""
    if header.key != key:
        raise CorruptChunkError(f"record holds key {header.key:032x}, expected {key:032x}")
    if header.dtype != dtype_name(out.dtype) or header.shape != tuple(out.shape):
        raise CorruptChunkError(
            f"record is {header.dtype}{list(header.shape)}, expected {dtype_name(out.dtype)}{list(out.shape)}"
        )
    if header.nbytes != out.numel() * out.element_size():
        raise CorruptChunkError(f"record payload of {header.nbytes} bytes does not match its shape")


def check_payload(header: ChunkHeader, payload: memoryview | bytes) -> None:
    if len(payload) != header.nbytes:
        raise CorruptChunkError(f"payload is {len(payload)} bytes, header says {header.nbytes}")
    if zlib.crc32(payload) != header.crc32:
        raise ChecksumMismatchError("payload checksum mismatch")


def out_buffer(out: torch.Tensor) -> memoryview:
    """Writable byte view of ``out`` for ``readinto`` / copies."""
    return out.view(torch.uint8).reshape(-1).numpy().data


__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER",
    "ChunkHeader",
    "check_fits",
    "check_payload",
    "decode_header",
    "decode_meta",
    "encode_header",
    "out_buffer",
    "tensor_bytes",
]
