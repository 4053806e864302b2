"""``KVCacheTier`` under vLLM 0.32's own tiering classes, against a real daemon.

vLLM runs in its venv (the ``vllm_python`` fixture), never in this one: ``vllm_side.py`` is the
vLLM side (``TieringOffloadingSpec`` builds the real CPU primary tier over a real shared region
and loads the tier through ``SecondaryTierFactory`` from its ``secondary_tiers`` entry), and
the daemons are started from here. What is proven (see each check in ``vllm_side.py``):

1. vLLM's factory loads the tier from ``{"type": "KVCacheTier", "module_path": ...}``, and a
   bad key fails the spec with ``ConfigError``;
2. chunks cascaded from vLLM's CPU tier come back byte for byte after that tier is reset, or
   after its LRU evicted them (a working set twice its size), as
   vLLM's own tiering tests' scenarios for a secondary tier ask (lookups, store/load into other
   chunks, jobs tracked apart, a load with a missing chunk, no livelock after a failed load,
   events, vLLM's backpressure detector, vLLM's reset with a cascade in flight);
3. two instances (two processes) sharing one daemon: the second finds and loads the first's
   chunks byte for byte; another tenant's salt finds nothing;
4. the daemon stopped and then killed under a load: the load fails, no chunk is reported
   loaded, and the instance goes on serving from its CPU tier; no daemon at all: the same.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcache.server.launch import DaemonProcess
from tests.helpers import daemon_starter

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    yield from daemon_starter(["--l1-size-gb", "0.25"])


def vllm_side(python: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run([python, str(HERE / "vllm_side.py"), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_tier_contract_under_vllm(
    vllm_python: str, start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    out = vllm_side(vllm_python, "unit", daemon.endpoint, str(tmp_path))
    assert "passed 5 checks" in out, out
    assert daemon.proc.poll() is None


def test_two_instances_share_one_daemon(vllm_python: str, start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon()
    assert "ok share_store" in vllm_side(vllm_python, "store", daemon.endpoint, "", "7")
    assert "ok share_load" in vllm_side(vllm_python, "load", daemon.endpoint, "", "7")
    assert "ok share_miss" in vllm_side(vllm_python, "miss", daemon.endpoint, "tenant-b", "7")


def test_daemon_killed_under_a_load(vllm_python: str, start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon()
    out = vllm_side(vllm_python, "kill", daemon.endpoint, str(daemon.proc.pid))
    assert "ok load_failed" in out and "ok keeps_serving" in out, out
    assert daemon.proc.wait(timeout=30) != 0  # it was killed, by the vLLM side
