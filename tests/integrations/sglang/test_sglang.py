"""SGLang tiers: kvcache as a HiCache storage backend, against SGLang 0.5.23's own classes.

SGLang runs in ``scripts/sglang_env.sh``'s venv (CPU torch, its pinned dependencies), never in
this one; ``sgl_unit.py`` is the SGLang side and a real daemon (started from here) the other.
The unit tier builds the backend through ``StorageBackendFactory`` with a real
``HiCacheStorageConfig``, over real CPU host pools in every layout and real ``get_hash_str``
keys: byte-for-byte round trips, prefix ``batch_exists``, MHA and MLA, zero copy, two
tensor-parallel ranks, two tenants, and a hybrid model's KV and Mamba pools (``HostPoolGroup``,
``MambaPoolHost``) through the v2 calls (see its checks).

The venv comes from the ``sglang_python`` fixture (tests/conftest.py): it skips where SGLang
cannot be installed (``sglang_env.sh`` exits 3) or with ``KVCACHE_SKIP_SGLANG=1``. About 40 s
with a built venv, about 3.5 minutes more to build it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcache.server.launch import DaemonProcess
from tests.helpers import daemon_starter
from tests.integrations.sglang.venv import sglang_env

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    yield from daemon_starter(["--l1-size-gb", "0.25", "--max-ids", "4096"])


def run_sglang(python: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([python, str(HERE / "sgl_unit.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=sglang_env(), cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_unit_tier_against_sglang_classes(
    sglang_python: str, start_daemon: Callable[..., DaemonProcess]
) -> None:
    daemon = start_daemon()
    out = run_sglang(sglang_python, daemon.endpoint)
    assert "passed 10 checks" in out, out
    assert daemon.proc.poll() is None
