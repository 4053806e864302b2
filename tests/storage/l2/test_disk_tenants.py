"""The disk tier shared out between tenants: room comes from the tenant holding the most of
it, never from one holding less than the writer, and a restart keeps every file's owner."""

from __future__ import annotations

import os
import random
import struct
import zlib
from pathlib import Path

import pytest
import torch

from kvcache.observability.event import EventType
from kvcache.records import dtype_name
from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.s3fifo import S3FIFOPolicy
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import EvictionPolicy
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.storage.l2.disk_scan import names
from tests.helpers import RecordingSink as Sink


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 16, 32, generator=g).to(torch.bfloat16)


def write(d: DiskL2Adapter, keys: range | list[int], tenant: str) -> None:
    """Each key written as ``AsyncL2`` writes a batch: with its tenant."""
    items = [(k, chunk(k), None) for k in keys]
    out = d.store_many_with_meta(items, [b""] * len(items), [tenant] * len(items))
    assert not [r for r in out if isinstance(r, Exception)], out


def file_size(tmp_path: Path, tenant: str) -> int:
    """The bytes of one chunk file written for ``tenant`` (its record names it)."""
    probe = DiskL2Adapter(str(tmp_path / f"probe-{len(tenant)}"), 1 << 20)
    write(probe, [0], tenant)
    size: int = probe.used_bytes
    return size


def held(d: DiskL2Adapter, keys: range | list[int]) -> list[int]:
    return [k for k, there in zip(keys, d.contains(list(keys)), strict=True) if there]


def test_a_tenant_storing_several_times_the_tier_never_evicts_another_tenants_files(tmp_path: Path) -> None:
    """Under one eviction order the flood evicted the small tenant's three files first (its
    oldest); now the flood pays with its own."""
    size = file_size(tmp_path, "a")  # "a" and "v" name tenants of one byte: files of one size
    d = DiskL2Adapter(str(tmp_path / "tier"), 10 * size)
    write(d, range(100, 103), "v")
    write(d, range(1000, 1050), "a")  # five times the tier
    assert held(d, range(100, 103)) == [100, 101, 102], "the flood evicted the small tenant's files"
    assert held(d, range(1000, 1050)) == list(range(1043, 1050))  # its newest, within the rest
    assert d.info()["tenant_bytes"] == {"v": 3 * size, "a": 7 * size}
    assert d.info()["used_bytes"] == 10 * size and len(list((tmp_path / "tier").rglob("*.kvc"))) == 10
    out = torch.empty_like(chunk(100))
    assert d.load(100, out) and torch.equal(out.view(torch.uint8), chunk(100).view(torch.uint8))


def test_the_writer_pays_among_equals(tmp_path: Path) -> None:
    """``b`` wrote first, so its files are the tier's oldest; ``a`` catching up to it pays
    for its own write, and the fuller one pays for the one holding less."""
    size = file_size(tmp_path, "a")
    d = DiskL2Adapter(str(tmp_path / "tier"), 7 * size)
    write(d, range(200, 204), "b")
    write(d, range(100, 103), "a")  # full: b 4, a 3
    assert d.victim_for(size, "a") == 100  # a's write would make it b's equal: it pays
    assert d.victim_for(size, "b") == 200  # b would hold more: b pays
    assert d.victim_for(size, "c") == 200  # a newcomer takes from the fullest
    write(d, [103], "a")  # a 4, b 4: a pays with its oldest, not b's (the tier's oldest)
    assert held(d, range(100, 104)) == [101, 102, 103] and held(d, range(200, 204)) == [200, 201, 202, 203]
    write(d, [300], "c")  # a newcomer takes from the fullest: b
    assert held(d, range(200, 204)) == [201, 202, 203] and d.contains([300]) == [True]
    assert d.info()["tenant_bytes"] == {"a": 3 * size, "b": 3 * size, "c": size}


def test_a_tenant_alone_fills_the_tier_and_a_newcomer_takes_from_it(tmp_path: Path) -> None:
    size = file_size(tmp_path, "a")
    d = DiskL2Adapter(str(tmp_path / "tier"), 10 * size)
    write(d, range(100, 115), "a")
    assert held(d, range(100, 115)) == list(range(105, 115))  # all of it, its oldest went
    assert d.victim_for(size, "a") == 105
    write(d, range(200, 205), "b")  # b holds less at each write: a pays
    assert held(d, range(200, 205)) == list(range(200, 205)) and held(d, range(100, 115)) == list(
        range(110, 115)
    )
    assert d.info()["tenant_bytes"] == {"a": 5 * size, "b": 5 * size}
    write(d, range(205, 210), "b")  # from equal shares on, b pays for its own
    assert held(d, range(200, 210)) == list(range(205, 210)) and held(d, range(100, 115)) == list(
        range(110, 115)
    )


@pytest.mark.parametrize("make", [LRUPolicy, S3FIFOPolicy])
@pytest.mark.parametrize(("seed", "tenant"), [(0, ""), (1, "t"), (2, "t"), (3, "uid:1000")])
def test_with_one_tenant_the_victims_are_the_plain_policys(
    tmp_path: Path, make: type[EvictionPolicy], seed: int, tenant: str
) -> None:
    """Stores (new keys and again), loads and deletes in a random order: the files evicted,
    in order, and the files kept are what one plain policy over the whole tier gives."""
    rng = random.Random(seed)
    size = file_size(tmp_path, tenant)
    sink = Sink()
    d = DiskL2Adapter(str(tmp_path / "tier"), 6 * size, bus=sink, policy=make)
    plain, kept, evicted = make(), set(), []
    for _ in range(150):
        key, op = rng.randrange(20), rng.randrange(4)
        if op <= 1:
            write(d, [key], tenant)
            if key in kept:
                plain.touch(key)
                continue
            kept.add(key)
            plain.add(key)
            while len(kept) > 6:
                victim = plain.victim()
                assert victim is not None
                plain.discard(victim)
                kept.discard(victim)
                evicted.append(victim)
        elif op == 2:
            assert d.load(key, torch.empty_like(chunk(key))) == (key in kept)
            plain.touch(key)
        else:
            assert d.delete([key]) == (key in kept)
            plain.discard(key)
            kept.discard(key)
    got = [k for ev in sink.of(EventType.L2_KEYS_EVICTED) for k in ev.metadata.keys]
    assert got == evicted and held(d, range(20)) == sorted(kept)
    assert d.info()["tenant_bytes"] == ({tenant: len(kept) * size} if kept else {})


def test_a_restart_charges_each_file_to_its_owner(tmp_path: Path) -> None:
    size = file_size(tmp_path, "a")
    d = DiskL2Adapter(str(tmp_path / "tier"), 8 * size)
    write(d, range(100, 103), "v")
    write(d, range(200, 205), "a")
    before = d.info()["tenant_bytes"]
    again = DiskL2Adapter(str(tmp_path / "tier"), 8 * size)
    assert again.info()["tenant_bytes"] == before == {"v": 3 * size, "a": 5 * size}
    write(again, range(300, 320), "a")  # after the restart too, a flood pays with its own
    assert held(again, range(100, 103)) == [100, 101, 102]
    smaller = DiskL2Adapter(str(tmp_path / "tier"), 6 * size)  # a smaller bound: the fullest pays
    assert smaller.info()["tenant_bytes"] == {"v": 3 * size, "a": 3 * size}


def test_a_file_without_a_tenant_is_charged_to_a_share_of_its_own_that_gives_way_first(
    tmp_path: Path,
) -> None:
    """Files written by older builds (versions 1 and 2 of the record, as the default tenant
    of library use still writes them) name no tenant: after a restart they count against
    "", one party, which pays first while it is the fullest."""
    old = file_size(tmp_path, "")
    size = file_size(tmp_path, "a")
    d = DiskL2Adapter(str(tmp_path / "tier"), 6 * size)
    d.store(100, chunk(100))  # version 1, byte for byte an older build's
    d.store_with_meta(101, chunk(101), None, b"\x90")  # version 2: meta, no tenant
    write(d, range(102, 105), "")
    for key in range(100, 105):
        with open(d._file(key), "rb") as f:
            assert codec.decode_header(f.read(codec.MAX_HEADER)).tenant_len == 0
    again = DiskL2Adapter(str(tmp_path / "tier"), 6 * size)
    assert again.info()["tenant_bytes"] == {"": 5 * old + 8 + 1}  # 101: meta fields, 1 byte of meta
    write(again, range(200, 210), "a")
    assert held(again, range(200, 210)) == list(range(207, 210))
    assert held(again, range(100, 105)) == [102, 103, 104]  # the oldest of "" gave way
    assert again.info()["tenant_bytes"] == {"": 3 * old, "a": 3 * size}


def _record(key: int, t: torch.Tensor, tenant: bytes, tenant_len: int) -> bytes:
    """A version 3 record built by hand from the documented layout, CRCs right, so only the
    tenant field is wrong."""
    payload = codec.tensor_bytes(t).tobytes()
    fixed = 4 + 2 + 2 + 16 + 16 + 1 + 8 * t.dim() + 12 + 8 + 2
    head = struct.pack("<4sHHQQ16sB", codec.MAGIC, 3, fixed, key & (2**64 - 1), key >> 64,
                       dtype_name(t.dtype).encode(), t.dim())  # fmt: skip
    head += struct.pack(f"<{t.dim()}Q", *t.shape) + struct.pack("<QI", len(payload), zlib.crc32(payload))
    head += struct.pack("<IIH", 0, zlib.crc32(tenant), tenant_len) + tenant
    return head + payload


@pytest.mark.parametrize(
    ("tenant", "tenant_len"),
    [
        (b"\xff\xfeuid:1000", 10),  # not UTF-8
        (b"a" * 4000, 4000),  # over the bound
        (b"", 0),  # a version 3 record names someone
        (b"a" * 4000, 3),  # its length disagrees with the file's size
    ],
)
def test_a_forged_or_oversized_tenant_is_dropped_as_damaged(
    tmp_path: Path, tenant: bytes, tenant_len: int
) -> None:
    d = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    write(d, [1], "a")
    t = chunk(7)
    raw = _record(7, t, tenant, tenant_len)
    sub, name = names(7, zlib.crc32(codec.tensor_bytes(t)))
    (tmp_path / "tier" / sub).mkdir(mode=0o700, exist_ok=True)
    path = tmp_path / "tier" / sub / name
    path.write_bytes(raw)
    os.chmod(path, 0o600)
    again = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    assert again.recovery["dropped"] == 1 and not path.exists()
    assert again.contains([1, 7]) == [True, False]
    assert again.info()["tenant_bytes"] == {"a": d.used_bytes}


def test_a_well_formed_hand_built_record_names_its_tenant(tmp_path: Path) -> None:
    """The layout the damaged records above start from is the one the tier reads."""
    t = chunk(7)
    raw = _record(7, t, "key:é".encode(), len("key:é".encode()))
    header = codec.decode_header(raw)
    assert codec.decode_extras(raw, header) == (b"", "key:é")
    assert raw[: header.header_len] == codec.encode_header(7, t, codec.tensor_bytes(t), tenant="key:é")
