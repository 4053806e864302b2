"""Run one of the scheduler harness's scripts in the vLLM venv and read the verdicts it writes.

The harness scripts (``sched_scenarios.py``, ``sched_controls.py``, ``sched_hybrid.py``,
``sched_mla.py``) import vLLM, so each runs in its own process under the venv's python, writes
its results as JSON (``--out``), and its test module reads them from one module-scoped fixture.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def run_script(
    python: str, script: str, out: Path, *args: str, timeout: float, exit_codes: tuple[int, ...] = (0,)
) -> dict[str, Any]:
    """``python HERE/script --out out *args``; its JSON, once it exited with one of
    ``exit_codes`` and wrote it (else the tail of its output is the failure)."""
    proc = subprocess.run(
        [python, str(HERE / script), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode in exit_codes and out.exists(), (proc.stdout + proc.stderr)[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    return data
