"""A disk tier's subdirectory swapped for a symlink while the daemon runs, against a real daemon.

Who can do it: the tier directory is the daemon's, 0700 (checked at start, then reached only
through a descriptor of it, so renaming a directory above it changes nothing), so only the
daemon's uid or root can replace an entry in it: a script of the operator's that "tidies"
the cache, a backup restored with links, a compromised process of that uid. Nothing protects
against root or against a process that can ptrace the daemon; but the daemon need not make
such a slip worse by following the link, reading KV from wherever it points and writing
prompts' KV there.

Before: a subdirectory checked once stayed trusted by name, and chunk files were opened as
``ab/ab...kvc`` relative to the tier: ``O_NOFOLLOW`` guards only the last component, so a
swapped ``ab`` was followed. A daemon served the KV a forger left behind the link (here, a
retrieve after the victim's chunks had left L1), and wrote new chunks through the link.
Now each access opens the subdirectory itself with ``O_NOFOLLOW`` and checks it (this uid,
0700) before touching a file in it: a link there is a miss for reads, a failed write for stores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import GiB
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.storage.l2 import codec
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

BS, CS, CHUNKS = 4, 16, 4  # chunk size 16 is the suite's (conftest BASE_ARGS)
BLOCKS = list(range(CHUNKS * CS // BS))
CHUNK_BYTES = 2 * 2 * CS * 2 * 8 * 2  # layers x (K, V) x tokens x heads x head size x fp16
VICTIM = [3_000 + t for t in range(CHUNKS * CS)]


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=len(BLOCKS),
                        block_size=BS, num_heads=2, head_size=8, dtype=torch.float16,
                        seed=seed)  # fmt: skip
    assert isinstance(kv, list)
    return to_shared(kv)


def _drained(c: KVCacheClient, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(t["inflight"]["store"] == 0 for t in c.status()["engine"]["l2"]):
        assert time.monotonic() < deadline, "L2 writes did not drain"
        time.sleep(0.01)


def _chunk_files(tier: Path) -> set[Path]:
    return {p for p in tier.glob("*/*.kvc")}


def _forge(real: Path, dest: Path) -> None:
    """A chunk file under ``real``'s name, valid header and CRC, holding ones (fp16 1.0)."""
    header = codec.decode_header(real.read_bytes()[: codec.MAX_HEADER])
    evil = torch.ones(header.shape, dtype=torch.float16)
    payload = codec.tensor_bytes(evil)
    dest.write_bytes(codec.encode_header(header.key, evil, payload) + payload.tobytes())
    dest.chmod(0o600)


def test_a_subdirectory_swapped_for_a_symlink_is_not_followed(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    tier, evil = tmp_path / "tier", tmp_path / "evil"
    l1_gb = 6 * CHUNK_BYTES / GiB  # room for 6 chunks: the next prompts push the victim's out
    d = start_daemon("--l1-size-gb", repr(l1_gb), "--l2-disk-path", str(tier),
                     "--l2-disk-size-gb", "0.01")  # fmt: skip
    ours = _cache(seed=1)
    want = clone_caches(ours)
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=30) as c:
        c.register_kv_caches(ours)
        assert c.store(VICTIM, BLOCKS).stored_chunks == CHUNKS
        _drained(c)
        victims = _chunk_files(tier)
        assert len(victims) == CHUNKS
        for i in range(3):  # 12 more chunks through an L1 of 6: the victim's leave L1
            assert c.store([50_000 + 1_000 * i + t for t in range(CHUNKS * CS)], BLOCKS).failed_chunks == 0
            _drained(c)
        # The swap: each subdirectory holding a victim chunk becomes a link to the forger's
        # directory, which holds a well-formed chunk file of other KV under each name.
        for sub in {p.parent for p in victims}:
            (evil / sub.name).mkdir(parents=True, mode=0o700)
            for f in victims:
                if f.parent == sub:
                    _forge(f, evil / sub.name / f.name)
            sub.rename(tmp_path / f"moved-{sub.name}")
            sub.symlink_to(evil / sub.name)
        for t in ours:
            t.fill_(0)
        got = c.retrieve(VICTIM, BLOCKS)
        served_forged = any(bool((t == 1).any()) for t in ours)  # zeros, unless KV was served
        assert not served_forged, f"the daemon followed the link and served the forger's KV ({got} tokens)"
        assert got == 0, f"{got} tokens served from behind a swapped subdirectory"
        assert not caches_equal(ours, want)  # nothing was served at all
        assert c.ping()


def test_a_store_never_writes_through_a_swapped_subdirectory(tmp_path: Path) -> None:
    """The write half, on the adapter (a daemon's keys cannot be steered into one
    subdirectory): a subdirectory the tier has written to, swapped for a link."""
    tier = DiskL2Adapter(str(tmp_path / "tier"), 1 << 20)
    chunk = torch.arange(64, dtype=torch.float16)
    k1, k2 = 0xAB << 120, (0xAB << 120) | 1
    tier.store(k1, chunk)
    sub, evil = tmp_path / "tier" / "ab", tmp_path / "evil"
    evil.mkdir(mode=0o700)
    sub.rename(tmp_path / "moved")
    sub.symlink_to(evil)
    try:
        tier.store(k2, chunk)
    except Exception as exc:  # refused is right; what matters is where the bytes went
        assert "symlink" in str(exc), exc
    assert os.listdir(evil) == [], "a chunk of KV was written through the link"
