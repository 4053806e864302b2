"""The disk tier's less-travelled paths, found by an attack pass (direct adapter tests).

1. A chunk path replaced, while the daemon runs, by a FIFO (not a regular file): ``load``
   opened it with O_RDONLY and blocked forever, wedging the L2 worker thread (a symlink at the
   same place is a corrupt chunk, removed, a miss; now so is anything but a regular file).
2. A subdirectory removed behind the daemon's back (``rm -rf tier/*`` to clear the cache, as
   a load already tolerates): every later store of a key under it failed until a restart,
   since the adapter remembered the subdirectory as checked; now a store makes it again.
3. A chunk file with bytes appended, for a small chunk: ``load`` raised an untyped
   ``ValueError`` (memoryview assignment) instead of ``CorruptChunkError``, so the file was
   neither removed nor counted as corrupt and every later load failed the same way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kvcache.errors import CorruptChunkError
from kvcache.storage.l2.disk import DiskL2Adapter

KEY = 0xAB << 120


def test_a_fifo_planted_at_a_chunk_path_never_wedges_a_load(tmp_path: Path) -> None:
    tier = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    chunk = torch.arange(1024, dtype=torch.float16)
    tier.store(KEY, chunk)
    path = tier._file(KEY)
    os.unlink(path)
    os.mkfifo(path, 0o600)
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(tier.load(KEY, torch.empty_like(chunk)))
        except Exception as exc:
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(3)
    wedged = worker.is_alive()
    if wedged:  # unblock the reader so the thread ends
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(3)
    assert not wedged, "load of a FIFO chunk path blocked for 3 s (an L2 worker thread wedged)"
    assert outcome and (outcome[0] is False or isinstance(outcome[0], CorruptChunkError)), outcome


def test_a_removed_subdirectory_does_not_stop_later_stores(tmp_path: Path) -> None:
    tier = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    chunk = torch.arange(1024, dtype=torch.float16)
    tier.store(KEY, chunk)
    shutil.rmtree(tmp_path / "tier" / "ab")  # the operator clears the cache's files
    out = torch.empty_like(chunk)
    assert tier.load(KEY, out) is False  # deleted behind its back: a miss (this holds)
    tier.store(KEY + 1, chunk)  # StorageError: [Errno 2] No such file or directory, forever
    assert tier.load(KEY + 1, out) and torch.equal(out, chunk)


def test_a_small_chunk_with_bytes_appended_is_a_corrupt_chunk(tmp_path: Path) -> None:
    tier = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    chunk = torch.arange(4, dtype=torch.float16)  # 8 payload bytes
    tier.store(KEY, chunk)
    with open(tier._file(KEY), "ab") as f:
        f.write(b"X" * 64)
    with pytest.raises(CorruptChunkError):
        tier.load(KEY, torch.empty_like(chunk))  # ValueError: memoryview assignment ...
    assert tier.contains([KEY]) == [False] and not os.path.exists(tier._file(KEY))
