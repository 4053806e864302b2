"""Disk L2: round trip, restart, corruption and truncation, size bound, disk full."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvcache.errors import CorruptChunkError, StorageError, UntrustedPathError
from kvcache.observability.event import Event, EventType, L2KeysEvicted
from kvcache.storage.l2.base import failure_reason
from kvcache.storage.l2.disk import DiskL2Adapter
from tests.helpers import RecordingSink as Sink


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 16, 32, generator=g).to(torch.bfloat16)


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_round_trip_contains_delete(tmp_path: Path) -> None:
    d = DiskL2Adapter(str(tmp_path), 1 << 20)
    t = chunk(1)
    n = d.store(42, t)
    assert n > t.numel() * 2 and d.store(42, t) == 0  # second store is a no-op
    assert d.contains([42, 43]) == [True, False]
    out = torch.empty_like(t)
    assert d.load(42, out) and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    assert not d.load(43, out)
    assert d.info()["num_chunks"] == 1 and d.info()["used_bytes"] == n
    assert d.delete([42, 43]) == 1 and d.contains([42]) == [False] and not files(tmp_path)


def test_survives_restart_and_drops_temp_files(tmp_path: Path) -> None:
    d = DiskL2Adapter(str(tmp_path), 1 << 20)
    for k in range(3):
        d.store(k, chunk(k))
    os.utime(d._file(0), (1, 1))  # oldest on disk -> LRU victim after restart
    stray = Path(d._file(1) + ".abcd.tmp")
    stray.write_bytes(b"half a write")
    (tmp_path / "README").write_text("not a chunk")
    d2 = DiskL2Adapter(str(tmp_path), 1 << 20)
    assert d2.contains([0, 1, 2, 3]) == [True, True, True, False]
    assert not stray.exists()
    out = torch.empty_like(chunk(0))
    assert d2.load(2, out) and torch.equal(out.view(torch.uint8), chunk(2).view(torch.uint8))
    # restart with a smaller bound evicts the oldest file (key 0)
    sink = Sink()
    d3 = DiskL2Adapter(str(tmp_path), d2.info()["used_bytes"] - 1, bus=sink)
    assert d3.contains([0, 1, 2]) == [False, True, True]
    assert sink.events[0].event_type is EventType.L2_KEYS_EVICTED and sink.events[0].metadata.keys == [0]
    # then what survived is announced once, for holdings trackers (KV events)
    found = sink.of(EventType.L2_KEYS_FOUND)
    assert len(found) == 1 and sorted(found[0].metadata.keys) == [1, 2]
    assert found[0].metadata.num_bytes == d3.info()["used_bytes"]
    empty_sink = Sink()
    DiskL2Adapter(str(tmp_path / "empty"), 1 << 20, bus=empty_sink)
    assert not empty_sink.events  # an empty tier announces nothing


@pytest.mark.parametrize(
    "damage", ["flip", "truncate_payload", "truncate_header", "empty", "extra", "other_key"]
)
def test_corrupt_file_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    d = DiskL2Adapter(str(tmp_path), 1 << 20)
    t = chunk(5)
    d.store(7, t)
    path = Path(d._file(7))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    elif damage == "truncate_payload":
        raw = raw[:-100]
    elif damage == "truncate_header":
        raw = raw[:20]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "extra":
        raw += b"\0"
    else:
        d.store(8, chunk(6))
        raw = bytearray(Path(d._file(8)).read_bytes())  # a valid record of another key
    path.write_bytes(bytes(raw))
    out = torch.zeros_like(t)
    with pytest.raises(CorruptChunkError) as info:
        d.load(7, out)
    assert failure_reason(info.value) == "corrupt"
    assert not path.exists() and d.contains([7]) == [False]
    assert not d.load(7, out)  # afterwards a plain miss


def test_load_into_wrong_geometry_is_rejected(tmp_path: Path) -> None:
    d = DiskL2Adapter(str(tmp_path), 1 << 20)
    d.store(1, chunk(1))
    with pytest.raises(CorruptChunkError):
        d.load(1, torch.empty(2, 2, 16, 32, dtype=torch.float16))


def test_size_bound_evicts_lru(tmp_path: Path) -> None:
    sink = Sink()
    probe = DiskL2Adapter(str(tmp_path / "probe"), 1 << 20)
    size = probe.store(0, chunk(0))
    d = DiskL2Adapter(str(tmp_path / "d"), 3 * size, bus=sink)
    for k in (1, 2, 3):
        d.store(k, chunk(k))
    d.load(1, torch.empty_like(chunk(1)))  # touch 1: 2 is now the oldest
    d.store(4, chunk(4))
    assert d.contains([1, 2, 3, 4]) == [True, False, True, True]
    ev = [e for e in sink.events if e.event_type is EventType.L2_KEYS_EVICTED]
    assert ev[-1].metadata == L2KeysEvicted(backend="disk", keys=[2], num_bytes=size)
    assert len(files(tmp_path / "d")) == 3 and d.info()["used_bytes"] == 3 * size


def test_chunk_larger_than_tier(tmp_path: Path) -> None:
    d = DiskL2Adapter(str(tmp_path), 100)
    with pytest.raises(StorageError):
        d.store(1, chunk(1))
    assert not files(tmp_path)


FULL_DISK = r"""
import resource, signal, sys, torch
from kvcache.errors import StorageError
from kvcache.storage.l2.base import failure_reason
from kvcache.storage.l2.disk import DiskL2Adapter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of a signal
d = DiskL2Adapter(sys.argv[1], 1 << 30)
small = torch.zeros(1, 1, 16, 8)
d.store(1, small)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))   # the "disk" holds 20 kB per file
try:
    d.store(2, torch.ones(1, 1, 1024, 8))         # 32 kB
except StorageError as e:
    print("failed", failure_reason(e))
print(d.contains([1, 2]))
out = torch.empty_like(small)
print(d.load(1, out))
"""


def test_disk_full_is_a_clean_failure(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["failed full", "[True, False]", "True"]
    names = [p.name for p in files(tmp_path)]
    assert len(names) == 1 and not any(n.endswith(".tmp") for n in names)  # no partial file left


def test_concurrent_stores_and_loads(tmp_path: Path) -> None:
    d = DiskL2Adapter(str(tmp_path), 1 << 24)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for k in range(20):
                d.store(k, chunk(k))  # every thread writes the same keys
                out = torch.empty_like(chunk(0))
                if d.load(k, out):
                    assert torch.equal(out.view(torch.uint8), chunk(k).view(torch.uint8))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert d.contains(list(range(20))) == [True] * 20 and len(files(tmp_path)) == 20


def test_concurrent_writers_events_agree_with_the_files(tmp_path: Path) -> None:
    """Replaying stored/evicted events in publish order gives exactly the files on disk,
    even with several writer threads evicting each other's keys (a router relies on it)."""
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    class Recorder:
        def publish(self, event: Event) -> None:
            with lock:
                log.extend(("evict", k) for k in event.metadata.keys)

    size = DiskL2Adapter(str(tmp_path / "probe"), 1 << 20).store(0, chunk(0))
    d = DiskL2Adapter(str(tmp_path / "l2"), 3 * size, bus=Recorder())

    def writer(base: int) -> None:
        for i in range(60):
            key = base + i % 7  # keys repeat, so re-stores race with evictions
            d.store(key, chunk(key), lambda n, key=key: log.append(("store", key)))

    threads = [threading.Thread(target=writer, args=(b,)) for b in (100, 104, 200, 300)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held: set[int] = set()
    for kind, key in log:
        (held.add if kind == "store" else held.discard)(key)
    on_disk = {int(p.name.split(".")[0], 16) for p in (tmp_path / "l2").rglob("*.kvc")}
    assert held == on_disk
    assert d.contains(sorted(on_disk)) == [True] * len(on_disk)


def test_a_full_disk_evicts_its_own_oldest_chunks_and_keeps_accepting_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills up (other files, a smaller volume than configured) used to stop the
    tier for good: every later write failed. Now it evicts its own oldest chunks and retries,
    bounds itself by the free space, and grows back when space returns."""
    d = DiskL2Adapter(str(tmp_path), 1 << 30)
    size = d.store(0, chunk(0))
    disk = {"holds": 4 * size}  # the real volume: room for 4 chunks, whatever we configured
    real_write = DiskL2Adapter._write

    def write(self: DiskL2Adapter, key: int, *args: object) -> None:
        if self.used_bytes + size > disk["holds"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskL2Adapter, "_write", write)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda _: shutil._ntuple_diskusage(disk["holds"], d.used_bytes,  # type: ignore[attr-defined]
                                                           max(0, disk["holds"] - d.used_bytes)))  # fmt: skip
    for key in range(1, 12):
        assert d.store(key, chunk(key)) == size, key  # never refused
    assert d.contains([11]) == [True] and d.contains([0]) == [False]  # oldest went first
    assert d.info()["num_chunks"] <= 4 and d.info()["capacity_bytes"] <= 4 * size
    out = torch.empty_like(chunk(11))
    assert d.load(11, out) and torch.equal(out.view(torch.uint8), chunk(11).view(torch.uint8))
    disk["holds"] = 100 * size  # space freed by someone else
    d.store(12, chunk(12))  # while the disk is the bound, every write re-reads it
    assert d.info()["capacity_bytes"] > 4 * size
    for key in range(13, 20):
        d.store(key, chunk(key))
    assert d.info()["num_chunks"] > 4 and d.contains([12]) == [True]


def test_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        root = tmp_path / "tier"
        d = DiskL2Adapter(str(root), 1 << 20)
        d.store(7, chunk(7))
    finally:
        os.umask(old)
    (f,) = files(root)
    assert f.stat().st_mode & 0o777 == 0o600
    assert root.stat().st_mode & 0o777 == 0o700 and f.parent.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(UntrustedPathError, match="chmod 700"):  # refused, not changed
        DiskL2Adapter(str(shared), 1 << 20)
    assert shared.stat().st_mode & 0o777 == 0o755


NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with chown")


def _plant(root: Path, how: str) -> None:
    """Leave ``root`` (a tier with chunk 0xab.. stored) as another user could have."""
    sub = root / "ab"
    (chunk_file,) = sub.glob(f"ab{'0' * 30}.*.kvc")
    if how == "foreign-owner":
        os.chown(root, NOBODY, NOBODY)
    elif how == "group-writable":
        os.chmod(root, 0o770)
    elif how == "foreign-subdir":
        os.chown(sub, NOBODY, NOBODY)
    elif how == "open-subdir":
        os.chmod(sub, 0o707)
    elif how == "symlinked-subdir":
        shutil.move(sub, root.parent / "elsewhere")
        sub.symlink_to(root.parent / "elsewhere")
    elif how == "symlink-in-root":
        (root / "README").symlink_to("/etc/passwd")
    elif how == "foreign-chunk":
        os.chown(chunk_file, NOBODY, NOBODY)
    elif how == "open-chunk":
        os.chmod(chunk_file, 0o666)
    elif how == "symlinked-chunk":
        forged = root.parent / "forged.kvc"
        shutil.move(chunk_file, forged)
        chunk_file.symlink_to(forged)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("foreign-owner", marks=needs_root),
        "group-writable",
        pytest.param("foreign-subdir", marks=needs_root),
        "open-subdir",
        "symlinked-subdir",
        "symlink-in-root",
        pytest.param("foreign-chunk", marks=needs_root),
        "open-chunk",
        "symlinked-chunk",
    ],
)
def test_a_planted_tier_is_refused_at_start(tmp_path: Path, how: str) -> None:
    """Issue 20, finding 4: whatever another user could have put or changed in the tier stops
    it at start (the daemon then refuses to start) instead of being served as KV."""
    root = tmp_path / "tier"
    key = int("ab" + "0" * 30, 16)
    DiskL2Adapter(str(root), 1 << 20).store(key, chunk(1))
    _plant(root, how)
    with pytest.raises(UntrustedPathError, match=r"chown|chmod|remove"):
        DiskL2Adapter(str(root), 1 << 20)


def test_a_symlinked_tier_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UntrustedPathError, match="symlink"):
        DiskL2Adapter(str(tmp_path / "link"), 1 << 20)


def test_a_chunk_replaced_by_a_symlink_while_running_is_never_read(tmp_path: Path) -> None:
    """Files are opened ``O_NOFOLLOW``: a link planted after the start check is a corrupt
    chunk (removed, a miss), and its target is never read into the engine's memory."""
    d = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    d.store(1, chunk(1))
    d.store(2, chunk(2))
    forged = tmp_path / "forged.kvc"
    shutil.copy(d._file(2), forged)  # a valid record: followed, it would load
    os.unlink(d._file(1))
    os.symlink(forged, d._file(1))
    out = torch.zeros_like(chunk(1))
    with pytest.raises(CorruptChunkError, match="symlink"):
        d.load(1, out)
    assert not out.any() and not os.path.lexists(d._file(1)) and d.contains([1]) == [False]


def test_renaming_the_tier_away_does_not_redirect_it(tmp_path: Path) -> None:
    """The tier works relative to the directory it checked, not to its path: a directory
    swapped in under that path later (by whoever can write its parent) is never used."""
    d = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    d.store(1, chunk(1))
    os.rename(tmp_path / "tier", tmp_path / "moved")
    (tmp_path / "tier").mkdir(mode=0o700)
    d.store(2, chunk(2))
    out = torch.empty_like(chunk(1))
    assert d.load(1, out) and torch.equal(out.view(torch.uint8), chunk(1).view(torch.uint8))
    assert not files(tmp_path / "tier") and len(files(tmp_path / "moved")) == 2


def test_a_restart_reads_back_each_chunks_identity_and_old_files_still_load(tmp_path: Path) -> None:
    """Version-2 files give their ``ChunkIdentity`` back in ``L2_KEYS_FOUND`` (a long one
    too: the payload starts past the first header read); a version-1 file left by an older
    build still loads and is found without one."""
    import msgspec

    from kvcache.observability.event import ChunkIdentity
    from kvcache.storage.l2 import codec

    first = DiskL2Adapter(str(tmp_path), 1 << 24)
    long_ident = ChunkIdentity(
        parent_key=(7 << 100).to_bytes(16, "little"), token_ids=list(range(70_000, 72_000))
    )
    short_ident = ChunkIdentity(block_hashes=[-1, 2**63 - 1], block_size=16, token_ids=[1] * 32)
    first.store_with_meta(1, chunk(1), None, msgspec.msgpack.encode(long_ident))
    first.store_with_meta(2, chunk(2), None, msgspec.msgpack.encode(short_ident))
    old = chunk(3)  # written as a build without meta wrote it: version 1, no meta
    first.store(3, old)
    assert Path(first._file(3)).read_bytes()[4:6] == (1).to_bytes(2, "little")
    assert (
        len(
            codec.encode_header(1, chunk(1), codec.tensor_bytes(chunk(1)), msgspec.msgpack.encode(long_ident))
        )
        > codec.MAX_HEADER
    )

    sink = Sink()
    again = DiskL2Adapter(str(tmp_path), 1 << 24, bus=sink)
    (found,) = sink.of(EventType.L2_KEYS_FOUND)
    by_key = dict(zip(found.metadata.keys, found.metadata.identities, strict=True))
    assert by_key == {1: long_ident, 2: short_ident, 3: None}
    for key, want in ((1, chunk(1)), (2, chunk(2)), (3, old)):
        out = torch.empty_like(want)
        assert again.load(key, out) and torch.equal(out, want)


def test_s3fifo_disk_tier_keeps_a_reused_chunk_through_one_hit_chunks(tmp_path: Path) -> None:
    """Under LRU ten one-hit chunks push out a chunk read once; under S3-FIFO it moved to the
    main queue when read, and the one-hit chunks leave from the small queue instead."""
    from kvcache.storage.l1.lru import LRUPolicy
    from kvcache.storage.l1.s3fifo import S3FIFOPolicy

    size = DiskL2Adapter(str(tmp_path / "probe"), 1 << 20).store(0, chunk(0))
    kept = {}
    for name, policy in (("lru", LRUPolicy), ("s3fifo", S3FIFOPolicy)):
        d = DiskL2Adapter(str(tmp_path / name), 5 * size, policy=policy)
        for k in range(5):
            d.store(k, chunk(k))
        assert d.load(0, torch.empty_like(chunk(0)))
        for k in range(100, 110):
            d.store(k, chunk(k))
        kept[name] = d.contains([0])[0]
        assert d.info()["used_bytes"] <= 5 * size and len(files(tmp_path / name)) == 5
    assert kept == {"lru": False, "s3fifo": True}
