"""``KVCACHE_REQUIRE_ENGINES=1`` (CI's ``.ci/run``) turns an engine that cannot be installed from
a skip into a failure (tests/conftest.py).

Each case runs pytest on one test that needs an engine's venv, in a subprocess, with the
engine's real build script pointed at an empty venv and pip kept off every index (its install
fails as a network blip would, and the script exits 3). Without the switch the test skips (the
control: the same setup, so it is the switch that makes the difference); with it, it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INNER = """
def test_needs_the_engine({fixture}):
    pass
"""
CLEARED = {  # what would skip the build, or hand the tests a venv built elsewhere
    "KVCACHE_REQUIRE_ENGINES",
    "KVCACHE_VLLM_PYTHON",
    "KVCACHE_SGLANG_PYTHON",
    "KVCACHE_SKIP_VLLM_E2E",
    "KVCACHE_SKIP_SGLANG",
}
ENGINES = [("vllm_python", "KVCACHE_VLLM_VENV"), ("sglang_python", "KVCACHE_SGLANG_VENV")]


def _run_inner(
    tmp_path: Path, fixture: str, venv_variable: str, require: bool
) -> subprocess.CompletedProcess[str]:
    test = tmp_path / f"test_inner_{fixture}.py"
    test.write_text(INNER.format(fixture=fixture))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("PIP_")}
    # No index and no pip.conf (which might name a local wheel directory): pip cannot install.
    env.update({venv_variable: str(tmp_path / "venv"), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if require:
        env["KVCACHE_REQUIRE_ENGINES"] = "1"
    # The project's conftest loaded as a plugin: the inner test sits outside tests/.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rsE",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.conftest",
        str(test),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a venv made and a pytest started per case
@pytest.mark.parametrize(("fixture", "venv_variable"), ENGINES)
def test_an_engine_that_cannot_be_installed_skips_outside_ci(
    tmp_path: Path, fixture: str, venv_variable: str
) -> None:
    proc = _run_inner(tmp_path, fixture, venv_variable, require=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 skipped" in out, out[-4000:]
    assert "cannot be installed here" in out, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(("fixture", "venv_variable"), ENGINES)
def test_an_engine_that_cannot_be_installed_fails_under_require_engines(
    tmp_path: Path, fixture: str, venv_variable: str
) -> None:
    proc = _run_inner(tmp_path, fixture, venv_variable, require=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 error" in out and "skipped" not in out, out[-4000:]
    assert "KVCACHE_REQUIRE_ENGINES=1 but the engine's tests cannot run" in out, out[-4000:]
    assert "cannot be installed here" in out, out[-4000:]


def test_ci_runs_the_readme_command_with_engines_required() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "export KVCACHE_REQUIRE_ENGINES=1" in ci
    assert ci[-1] == "bash scripts/test.sh"
