"""The on-tier chunk record: a self-describing header followed by the raw chunk bytes.

Shared by every L2 tier so a chunk read back from disk or Redis is checked the same way: the
header names the key, dtype and shape and carries a CRC32 of the payload, so a truncated,
corrupted, misplaced or foreign record is detected before a byte reaches the engine's cache.
CRC32 (``zlib``, ~6 GB/s here, releases the GIL) is for accidents, not attacks: tiers are trusted
storage; xxhash is not a dependency.

Layout (little-endian)::

    magic "KVC\\x01" | version u16 | header_len u16 | key u128 | dtype 16s (ascii, NUL-padded)
    | ndim u8 | shape ndim x u64 | nbytes u64 | crc32 u32
    | [version 2 and 3: meta_len u32 | meta_crc32 u32] | [version 3 only: tenant_len u16]
    | meta (meta_len bytes) | [version 3 only: tenant (tenant_len bytes, UTF-8)]
    | payload (nbytes bytes)

``header_len`` is the size of the fixed part (up to and including ``meta_crc32``, or
``tenant_len``). Version 2 adds ``meta``: what the tier keeps about the chunk besides its bytes
(the disk tier: how KV events announced it, ``ChunkIdentity``), with its own CRC. Version 3
(the disk tier only) adds the tenant whose share of the tier the chunk counts against
(``storage.shares``), so a restart charges each file to its owner again; ``meta_crc32`` then
covers the meta and the tenant. A record without meta or tenant is still written as version
1, and one with meta only as version 2, byte for byte what older builds write and read (they
share Redis, and the Redis tiers never write a tenant); an older build drops a version 3 file
as damaged, so a downgrade loses the disk chunks of named tenants, a cache's loss only.

The tenant is read back from a file the daemon wrote, but still as untrusted bytes: at most
``MAX_TENANT`` of them, and strict UTF-8 naming someone (not empty), else the record is
corrupt (``decode_extras``) and dropped like any damaged one.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import msgspec
import torch

from kvcache.errors import ChecksumMismatchError, CorruptChunkError
from kvcache.records import ChunkIdentity, ChunkKey, dtype_name

MAGIC = b"KVC\x01"
FORMAT_VERSION = 3
"""The newest record version this build writes (for records with a tenant) and reads (1 to 3)."""
_FIXED = struct.Struct("<4sHHQQ16sB")  # magic, version, header_len, key lo, key hi, dtype, ndim
_TAIL = struct.Struct("<QI")  # nbytes, crc32
_META = struct.Struct("<II")  # versions 2 and 3: meta_len, meta crc32 (version 3: of meta + tenant)
_TENANT = struct.Struct("<H")  # version 3: tenant_len
MAX_HEADER = _FIXED.size + 8 * 8 + _TAIL.size + _META.size + _TENANT.size
"""The largest fixed part: reading this many bytes is enough to find the payload."""
MAX_TENANT = 255
"""Most bytes of a recorded tenant; a longer name is recorded as ``bounded_tenant`` makes it."""
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
    tenant_len: int = 0
    """Bytes of the tenant at the end of the header (0: none recorded, versions 1 and 2)."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 and fp8 included)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("chunk must be a contiguous CPU tensor")
    return t.view(torch.uint8).reshape(-1).numpy().data


def bounded_tenant(tenant: str) -> str:
    """``tenant`` as a record holds it: itself when it fits ``MAX_TENANT`` bytes, else its
    head and a digest of the whole name (operators may name CURVE clients at any length), so
    a restart charges the file to the same name the running tier charged it to."""
    raw = tenant.encode("utf-8")
    if len(raw) <= MAX_TENANT:
        return tenant
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return f"{raw[: MAX_TENANT - 40].decode('utf-8', 'ignore')}~{digest}"


def encode_header(
    key: ChunkKey, chunk: torch.Tensor, payload: memoryview, meta: bytes = b"", tenant: str = ""
) -> bytes:
    """Everything before the payload: the fixed part, then ``meta`` (version 2) if any, and
    ``tenant`` (version 3: the disk tier's owner of the chunk, at most ``MAX_TENANT`` bytes;
    "" records none)."""
    shape = tuple(chunk.shape)
    if len(shape) > 8:
        raise ValueError("chunk rank above 8")
    owner = tenant.encode("utf-8")
    if len(owner) > MAX_TENANT:
        raise ValueError(f"tenant of {len(owner)} bytes, at most {MAX_TENANT} are recorded")
    version = 3 if owner else 2 if meta else 1
    extra = {1: 0, 2: _META.size, 3: _META.size + _TENANT.size}[version]
    fixed_len = _FIXED.size + 8 * len(shape) + _TAIL.size + extra
    parts = [
        _FIXED.pack(
            MAGIC,
            version,
            fixed_len,
            key & _M64,
            key >> 64,
            dtype_name(chunk.dtype).encode("ascii"),
            len(shape),
        ),
        struct.pack(f"<{len(shape)}Q", *shape),
        _TAIL.pack(len(payload), zlib.crc32(payload)),
    ]
    if version == 2:
        parts += [_META.pack(len(meta), zlib.crc32(meta)), meta]
    elif version == 3:
        parts += [_META.pack(len(meta), zlib.crc32(meta + owner)), _TENANT.pack(len(owner)), meta, owner]
    return b"".join(parts)


def decode_header(buf: bytes | memoryview) -> ChunkHeader:
    """Parse the fixed part at the start of ``buf`` (the meta need not be there yet);
    raises ``CorruptChunkError`` when malformed."""
    if len(buf) < _FIXED.size:
        raise CorruptChunkError(f"record of {len(buf)} bytes is shorter than a header")
    magic, version, header_len, lo, hi, dt, ndim = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {magic!r}")
    if version not in (1, 2, 3):
        raise CorruptChunkError(f"record format version {version}, this build reads 1 to {FORMAT_VERSION}")
    extra = {1: 0, 2: _META.size, 3: _META.size + _TENANT.size}[version]
    if ndim > 8 or header_len != _FIXED.size + 8 * ndim + _TAIL.size + extra or len(buf) < header_len:
        raise CorruptChunkError("truncated or inconsistent header")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    tail = _FIXED.size + 8 * ndim
    nbytes, crc = _TAIL.unpack_from(buf, tail)
    meta_len = meta_crc = tenant_len = 0
    if version >= 2:
        meta_len, meta_crc = _META.unpack_from(buf, tail + _TAIL.size)
    if version == 3:
        (tenant_len,) = _TENANT.unpack_from(buf, tail + _TAIL.size + _META.size)
        if not 0 < tenant_len <= MAX_TENANT:  # read as untrusted: bounded, and naming someone
            raise CorruptChunkError(f"record names a tenant of {tenant_len} bytes (1 to {MAX_TENANT})")
    return ChunkHeader(
        key=lo | (hi << 64),
        dtype=dt.rstrip(b"\0").decode("ascii", "replace"),
        shape=tuple(shape),
        nbytes=nbytes,
        crc32=crc,
        header_len=header_len + meta_len + tenant_len,
        meta_offset=header_len,
        meta_crc32=meta_crc,
        tenant_len=tenant_len,
    )


def decode_extras(buf: bytes | memoryview, header: ChunkHeader) -> tuple[bytes, str | None]:
    """The record's meta (``b""`` for version 1) and tenant (None: none recorded, versions 1
    and 2); ``buf`` must reach the payload. A tenant that is not strict UTF-8 is corrupt."""
    if header.meta_offset == header.header_len:
        return b"", None
    if len(buf) < header.header_len:
        raise CorruptChunkError("record ends inside its meta")
    extras = bytes(buf[header.meta_offset : header.header_len])
    if zlib.crc32(extras) != header.meta_crc32:
        raise CorruptChunkError("meta checksum mismatch")
    if not header.tenant_len:
        return extras, None
    meta, owner = extras[: -header.tenant_len], extras[-header.tenant_len :]
    try:
        return meta, owner.decode("utf-8", "strict")
    except UnicodeDecodeError:
        raise CorruptChunkError("record's tenant is not UTF-8") from None


def decode_meta(buf: bytes | memoryview, header: ChunkHeader) -> bytes:
    """The record's meta (``b""`` for version 1); ``buf`` must reach the payload."""
    return decode_extras(buf, header)[0]


def chunk_identity(meta: bytes) -> ChunkIdentity | None:
    """How KV events announced the chunk, as its record's meta says; None for a record
    without one (written by an older build, or promoted by a hit) or one that does not decode
    (written by a build with another meta: the chunk is then announced by key only)."""
    if not meta:
        return None
    try:
        return msgspec.msgpack.decode(meta, type=ChunkIdentity)
    except msgspec.MsgspecError:
        return None


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
    "MAX_TENANT",
    "ChunkHeader",
    "bounded_tenant",
    "check_fits",
    "check_payload",
    "chunk_identity",
    "decode_extras",
    "decode_header",
    "decode_meta",
    "encode_header",
    "out_buffer",
    "tensor_bytes",
]
