"""Issue 20, finding 4: a planted disk tier stops the daemon instead of serving another user's KV.

Before the fix ``--l2-disk-path`` took a directory another user had created (say under
/tmp); that user then replaced the chunk files (their CRC is no MAC), and after a restart the
victim was served the attacker's bytes. Each test plants one way (another owner, an open mode,
a symlink for the directory, a subdirectory or a chunk file) and checks that a real daemon
refuses to start, saying how to fix it; a daemon on a private directory still serves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess, DaemonStartError
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

NOBODY = 65534
TOKENS, BLOCKS = list(range(64)), list(range(16))
DISK = ["--l2-disk-size-gb", "0.05"]


def _cache(seed: int = 0) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def _plant(root: Path, how: str) -> Path:
    """A disk-tier directory as another user could have left it; returns the flag's path."""
    root.mkdir(mode=0o700)
    sub = root / "ab"
    if how == "foreign-owner":
        os.chown(root, NOBODY, NOBODY)
    elif how == "group-writable":
        os.chmod(root, 0o770)
    elif how == "symlink":
        link = root.parent / "tier-link"
        link.symlink_to(root)
        return link
    elif how == "foreign-subdir":
        sub.mkdir(mode=0o700)
        os.chown(sub, NOBODY, NOBODY)
    elif how == "symlinked-subdir":
        elsewhere = root.parent / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        sub.symlink_to(elsewhere)
    elif how == "symlinked-chunk":
        sub.mkdir(mode=0o700)
        forged = root.parent / "forged.kvc"
        forged.write_bytes(b"attacker bytes")
        (sub / f"ab{'0' * 30}.kvc").symlink_to(forged)
    return root


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with chown")
PLANTS = ["foreign-owner", "group-writable", "symlink", "foreign-subdir", "symlinked-subdir",
          "symlinked-chunk"]  # fmt: skip


@needs_root
@pytest.mark.parametrize("how", PLANTS)
def test_the_daemon_refuses_a_planted_disk_tier(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, how: str
) -> None:
    path = _plant(tmp_path / "tier", how)
    with pytest.raises(DaemonStartError) as refused:
        start_daemon("--l2-disk-path", str(path), *DISK)
    log = str(refused.value)
    assert "exited with status 1" in log and str(tmp_path) in log
    assert any(fix in log for fix in ("chown", "chmod", "remove", "rm ")), log


def test_a_private_disk_tier_still_serves_across_a_restart(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    tier = ["--l2-disk-path", str(tmp_path / "tier"), *DISK]
    kv = _cache(5)
    want = clone_caches(kv)
    first = start_daemon(*tier)
    with KVCacheClient(first.endpoint, 1, "tenant", timeout_s=10) as c:
        c.register_kv_caches(kv)
        assert c.store(TOKENS, BLOCKS).stored_tokens == 64
    assert first.stop() == 0
    mode = (tmp_path / "tier").stat().st_mode & 0o777
    subdirs = [p for p in (tmp_path / "tier").iterdir() if p.is_dir()]
    assert mode == 0o700 and subdirs and all(p.stat().st_mode & 0o777 == 0o700 for p in subdirs)
    second = start_daemon(*tier)  # an empty L1: the chunks come back from the disk
    with KVCacheClient(second.endpoint, 2, "tenant", timeout_s=10) as c:
        c.register_kv_caches(kv)
        for t in kv:
            t.zero_()
        assert c.retrieve(TOKENS, BLOCKS) == 64 and caches_equal(kv, want)
