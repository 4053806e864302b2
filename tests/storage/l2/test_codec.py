"""The chunk record (kvcache.storage.l2.codec): round trip and every kind of damage detected."""

from __future__ import annotations

import pytest
import torch

from kvcache.errors import CorruptChunkError
from kvcache.records import dtype_name
from kvcache.storage.l2 import codec

KEY = (0xDEADBEEF << 64) | 0x1234


def record(t: torch.Tensor, key: int = KEY) -> bytes:
    payload = codec.tensor_bytes(t)
    return codec.encode_header(key, t, payload) + payload.tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_round_trip(dtype: torch.dtype) -> None:
    t = (
        torch.randint(0, 256, (2, 3, 16, 8), dtype=torch.uint8).view(dtype)
        if dtype.itemsize == 1
        else (torch.randn(2, 3, 16, 8).to(dtype))
    )
    buf = memoryview(record(t))
    h = codec.decode_header(buf)
    assert (h.key, h.shape, h.dtype) == (KEY, (2, 3, 16, 8), dtype_name(dtype))
    out = torch.empty_like(t)
    codec.check_fits(h, KEY, out)
    payload = buf[h.header_len :]
    codec.check_payload(h, payload)
    codec.out_buffer(out)[:] = payload
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_damage_is_detected() -> None:
    t = torch.randn(2, 2, 16, 8)
    good = record(t)
    h = codec.decode_header(good)
    out = torch.empty_like(t)
    with pytest.raises(CorruptChunkError, match="magic"):
        codec.decode_header(b"XXXX" + good[4:])
    with pytest.raises(CorruptChunkError, match="shorter"):
        codec.decode_header(good[:10])
    with pytest.raises(CorruptChunkError, match="truncated"):
        codec.decode_header(good[: h.header_len - 1])
    with pytest.raises(CorruptChunkError, match="version"):
        codec.decode_header(good[:4] + b"\x09\x00" + good[6:])
    with pytest.raises(CorruptChunkError, match="key"):
        codec.check_fits(h, KEY + 1, out)
    with pytest.raises(CorruptChunkError, match="expected"):
        codec.check_fits(h, KEY, torch.empty(2, 2, 16, 4))
    with pytest.raises(CorruptChunkError, match="expected"):
        codec.check_fits(h, KEY, torch.empty(2, 2, 16, 8, dtype=torch.float16))
    flipped = bytearray(good)
    flipped[-5] ^= 0x40
    with pytest.raises(CorruptChunkError, match="checksum"):
        codec.check_payload(h, memoryview(bytes(flipped))[h.header_len :])
    with pytest.raises(CorruptChunkError, match="payload is"):
        codec.check_payload(h, memoryview(good)[h.header_len : -1])


def test_a_record_with_meta_is_version_2_and_keeps_it() -> None:
    t = torch.randn(2, 2, 16, 8)
    payload = codec.tensor_bytes(t)
    meta = b"announcement record" * 50
    buf = codec.encode_header(KEY, t, payload, meta) + payload.tobytes()
    h = codec.decode_header(buf[: codec.MAX_HEADER])  # the fixed part is enough to find the payload
    assert int.from_bytes(buf[4:6], "little") == 2
    assert codec.decode_meta(buf, h) == meta
    codec.check_payload(h, buf[h.header_len :])
    damaged = bytearray(buf)
    damaged[h.header_len - 3] ^= 0xFF  # inside the meta
    with pytest.raises(CorruptChunkError, match="meta"):
        codec.decode_meta(bytes(damaged), codec.decode_header(bytes(damaged)))


def test_a_version_1_record_written_by_an_older_build_still_reads() -> None:
    """Built by hand from the documented v1 layout, not by ``encode_header``."""
    import struct
    import zlib

    t = torch.randn(2, 2, 16, 8)
    body = codec.tensor_bytes(t).tobytes()
    fixed = "<4sHHQQ16sB"  # magic, version, header_len, key lo, key hi, dtype, ndim
    size = struct.calcsize(fixed) + 4 * 8 + struct.calcsize("<QI")
    head = struct.pack(fixed, b"KVC\x01", 1, size, KEY & (2**64 - 1), KEY >> 64, b"float32", 4)
    head += struct.pack("<4Q", 2, 2, 16, 8) + struct.pack("<QI", len(body), zlib.crc32(body))
    h = codec.decode_header(head + body)
    assert (h.key, h.shape, h.header_len) == (KEY, (2, 2, 16, 8), len(head))
    assert codec.decode_meta(head + body, h) == b""
    codec.check_payload(h, (head + body)[h.header_len :])
    # and a record without meta is still written as version 1 (older readers share Redis)
    assert codec.encode_header(KEY, t, codec.tensor_bytes(t)) == head


def test_a_record_with_a_tenant_is_version_3_and_keeps_meta_and_tenant() -> None:
    t = torch.randn(2, 2, 16, 8)
    payload = codec.tensor_bytes(t)
    for meta in (b"", b"announcement record" * 50):
        buf = codec.encode_header(KEY, t, payload, meta, "key:team-a") + payload.tobytes()
        h = codec.decode_header(buf[: codec.MAX_HEADER])  # the fixed part still finds the payload
        assert int.from_bytes(buf[4:6], "little") == 3 and h.tenant_len == len("key:team-a")
        assert codec.decode_extras(buf, h) == (meta, "key:team-a") and codec.decode_meta(buf, h) == meta
        codec.check_payload(h, buf[h.header_len :])
        damaged = bytearray(buf)
        damaged[h.header_len - 1] ^= 0x01  # the tenant's last byte: the meta CRC covers it
        with pytest.raises(CorruptChunkError, match="meta checksum"):
            codec.decode_extras(bytes(damaged), codec.decode_header(bytes(damaged)))
    assert codec.decode_extras(record(t), codec.decode_header(record(t))) == (b"", None)  # none recorded


def test_a_tenant_is_bounded_when_written_and_when_read() -> None:
    t = torch.randn(2, 2, 16, 8)
    payload = codec.tensor_bytes(t)
    longest = "é" * (codec.MAX_TENANT // 2)  # 254 bytes
    assert codec.bounded_tenant(longest) == longest
    with pytest.raises(ValueError, match="at most"):
        codec.encode_header(KEY, t, payload, tenant="k" * (codec.MAX_TENANT + 1))
    long_names = ["key:" + "x" * 300, "key:" + "x" * 299 + "y", "key:" + "é" * 300]
    recorded = [codec.bounded_tenant(n) for n in long_names]
    assert len(set(recorded)) == 3 and all(len(r.encode()) <= codec.MAX_TENANT for r in recorded)
    assert recorded[0].startswith("key:xxx") and codec.bounded_tenant(long_names[0]) == recorded[0]
    buf = bytearray(codec.encode_header(KEY, t, payload, tenant="a"))
    at = codec.decode_header(bytes(buf)).meta_offset - 2  # tenant_len, the last field
    for forged in (0, codec.MAX_TENANT + 1, 0xFFFF):
        buf[at : at + 2] = forged.to_bytes(2, "little")
        with pytest.raises(CorruptChunkError, match="tenant"):
            codec.decode_header(bytes(buf))
