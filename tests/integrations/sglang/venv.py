"""How SGLang runs for the SGLang tiers (unit, end to end): in ``scripts/sglang_env.sh``'s venv
(the ``sglang_python`` fixture of tests/conftest.py), never in this one, with the test-only shims
and then this tree first on its ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SHIMS = Path(__file__).resolve().parent / "cishim"


def sglang_env(**extra: str) -> dict[str, str]:
    """The environment an SGLang process runs in: the test-only shims, then this tree."""
    return {**os.environ, "PYTHONPATH": f"{SHIMS}:{REPO}", **extra}
