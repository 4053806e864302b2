"""The SGLang venv for the SGLang tiers (unit, end to end): where it is and how SGLang runs in it.

SGLang runs in ``scripts/sglang_env.sh``'s venv (CPU torch, its pinned dependencies), never in
this one. ``KVCACHE_SKIP_SGLANG=1`` skips; ``KVCACHE_SGLANG_PYTHON`` names a venv's python built
elsewhere (a second checkout of the repository) so the script, which links the venv to its own
checkout, is not run. The tiers put this tree first on the venv's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SHIMS = Path(__file__).resolve().parent / "cishim"


@pytest.fixture(scope="session")
def sglang_python() -> str:
    if os.environ.get("KVCACHE_SKIP_SGLANG") == "1":
        pytest.skip("KVCACHE_SKIP_SGLANG=1")
    given = os.environ.get("KVCACHE_SGLANG_PYTHON")
    if given:
        return given
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "sglang_env.sh")], capture_output=True, text=True, timeout=1200
    )
    if proc.returncode == 3:
        pytest.skip(f"SGLang cannot be installed here:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def sglang_env(**extra: str) -> dict[str, str]:
    """The environment an SGLang process runs in: the test-only shims, then this tree."""
    return {**os.environ, "PYTHONPATH": f"{SHIMS}:{REPO}", **extra}
