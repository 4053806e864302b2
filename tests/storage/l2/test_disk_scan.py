"""The disk tier across crashes and restarts: every fault leaves only whole, verified chunks
served, the rest a counted miss (``disk_scan``; ``DiskL2Adapter.load`` checks).

Faults: a daemon SIGKILLed in the middle of writing a chunk, a torn payload (size intact), a
torn header, a truncated file, a file renamed under another checksum, a record of another
geometry under a chunk's name, and files left by a build that named them without checksum.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kvcache.errors import ChecksumMismatchError, CorruptChunkError
from kvcache.observability.event import EventType
from kvcache.storage.l2 import codec
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.storage.l2.disk_scan import parse_name, rel_name
from tests.helpers import RecordingSink as Sink

ROOT = Path(__file__).resolve().parents[3]


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 16, 32, generator=g).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tier_with(path: Path, keys: range) -> DiskL2Adapter:
    d = DiskL2Adapter(str(path), 1 << 24)
    for k in keys:
        d.store(k, chunk(k))
    return d


def test_names_carry_the_checksum_and_parse_back() -> None:
    assert rel_name(0xAB << 120, 0xDEADBEEF) == f"ab/{0xAB << 120:032x}.deadbeef.kvc"
    assert parse_name(f"{5:032x}.0000002a.kvc") == (5, 42)
    assert parse_name(f"{5:032x}.kvc") == (5, None)  # an older build's name
    assert parse_name("README.kvc") is None and parse_name(f"{5:032x}.xyz.kvc") is None


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from kvcache.storage.l2 import disk
    from kvcache.storage.l2.disk import DiskL2Adapter

    def chunk(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 2, 16, 32, generator=g).to(torch.bfloat16)

    d = DiskL2Adapter(sys.argv[1], 1 << 24)
    for k in range(5):
        d.store(k, chunk(k))

    class Stalls:  # the file of the 6th write: header and part of the payload, then stuck
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
        def write(self, b):
            n = self.f.write(b[: max(1, len(b) // 3)])
            if len(b) > 200:  # the payload: announce the crash point and wait to be killed
                print("mid-write", flush=True)
                sys.stdin.read()
            return n

    disk.open = lambda fd, *a, **k: Stalls(open(fd, *a, **k))
    d.store(5, chunk(5))
    """
)


def test_sigkill_mid_write_leaves_only_the_whole_chunks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "mid-write"  # the 6th chunk is half on disk
        assert len(list(tmp_path.rglob("*.tmp"))) == 1
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    d = DiskL2Adapter(str(tmp_path), 1 << 24)
    assert d.contains(list(range(6))) == [True] * 5 + [False]
    assert not list(tmp_path.rglob("*.tmp"))  # the torn write was removed
    for k in range(5):
        out = torch.empty_like(chunk(k))
        assert d.load(k, out) and same(out, chunk(k))


@pytest.mark.parametrize("fault", ["truncated", "extended", "torn_header", "renamed_crc", "empty"])
def test_a_restart_drops_files_that_are_not_whole(tmp_path: Path, fault: str) -> None:
    d = tier_with(tmp_path, range(3))
    path = Path(d._file(1))
    raw = bytearray(path.read_bytes())
    if fault == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif fault == "extended":
        path.write_bytes(raw + b"\0" * 16)
    elif fault == "torn_header":
        raw[:24] = os.urandom(24)
        path.write_bytes(raw)
    elif fault == "renamed_crc":
        key, crc = parse_name(path.name) or (0, 0)
        path.rename(path.with_name(rel_name(key, (crc or 0) ^ 1).split("/")[1]))
    else:
        path.write_bytes(b"")
    again = DiskL2Adapter(str(tmp_path), 1 << 24)
    assert again.contains([0, 1, 2]) == [True, False, True]
    assert again.info()["recovery"]["dropped"] == 1 and again.info()["recovery"]["files"] == 2
    assert len(list(tmp_path.rglob("*.kvc"))) == 2  # removed, not only skipped
    out = torch.empty_like(chunk(2))
    assert again.load(2, out) and same(out, chunk(2))


def test_a_torn_payload_is_a_counted_miss_never_served(tmp_path: Path) -> None:
    d = tier_with(tmp_path, range(2))
    path = Path(d._file(1))
    raw = bytearray(path.read_bytes())
    raw[-40:] = bytes(b ^ 0xFF for b in raw[-40:])  # same size, header intact: the scan keeps it
    path.write_bytes(raw)
    sink = Sink()
    tier = AsyncL2(DiskL2Adapter(str(tmp_path), 1 << 24), bus=sink)
    try:
        assert tier.contains([0, 1]) == [True, True]
        out = torch.zeros_like(chunk(1))
        got: list[bool] = []
        done = threading.Event()
        assert tier.submit_load(1, out, lambda ok: (got.append(ok), done.set()))
        assert done.wait(10) and got == [False]  # a miss: the caller never uses ``out``
        (bad,) = sink.of(EventType.L2_CHECKSUM_FAILED)
        assert bad.metadata.keys == [1] and "payload checksum" in bad.metadata.detail
        assert sink.of(EventType.L2_LOAD_FAILED)[-1].metadata.reason == "corrupt"
        assert tier.contains([0, 1]) == [True, False] and not path.exists()
    finally:
        tier.close()


def test_a_record_swapped_in_under_the_same_name_fails_the_metadata_checksum(tmp_path: Path) -> None:
    """The file's content replaced by another whole record of the same key (a stale copy, a
    rewrite torn across writers): the header's CRC disagrees with the one in the name."""
    d = tier_with(tmp_path, range(1))
    path = Path(d._file(0))
    other = chunk(99)
    payload = codec.tensor_bytes(other)
    path.write_bytes(codec.encode_header(0, other, payload) + bytes(payload))
    with pytest.raises(ChecksumMismatchError, match="tier metadata"):
        d.load(0, torch.empty_like(other))
    assert d.contains([0]) == [False] and not path.exists()


def test_a_record_of_another_geometry_is_a_miss(tmp_path: Path) -> None:
    """A whole, self-consistent record whose shape is not the chunk the reader expects (a
    tier shared with a daemon of another geometry, a planted file): refused, removed."""
    d = DiskL2Adapter(str(tmp_path), 1 << 24)
    wide = torch.ones(2, 2, 16, 64, dtype=torch.bfloat16)
    d.store(7, wide)
    again = DiskL2Adapter(str(tmp_path), 1 << 24)
    assert again.contains([7]) == [True]  # whole and consistent: the scan keeps it
    out = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(CorruptChunkError, match="expected"):
        again.load(7, out)
    assert again.contains([7]) == [False] and not list(tmp_path.rglob("*.kvc"))


def test_files_of_an_older_build_are_verified_and_renamed(tmp_path: Path) -> None:
    d = tier_with(tmp_path, range(2))
    for k in range(2):
        path = Path(d._file(k))
        path.rename(path.with_name(f"{k:032x}.kvc"))  # the name an older build gave it
    Path(d._file(1)).with_name(f"{1:032x}.kvc").write_bytes(b"KVC\x01 torn")
    again = DiskL2Adapter(str(tmp_path), 1 << 24)
    assert again.contains([0, 1]) == [True, False]
    renamed = Path(again._file(0))
    assert renamed.exists() and renamed.name != f"{0:032x}.kvc" and parse_name(renamed.name) is not None
    out = torch.empty_like(chunk(0))
    assert again.load(0, out) and same(out, chunk(0))
