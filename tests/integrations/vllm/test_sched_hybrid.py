"""The connector under vLLM's hybrid KV cache manager: ``sched_hybrid.py`` run in the vLLM venv.

vLLM's real ``Scheduler`` and ``AsyncScheduler`` with a full-attention, a sliding-window and a
Mamba group, the hybrid manager on, kvcache's connector in both roles, and a fake model whose
next token depends on every group's state (what each scenario proves is in its docstring).
The controls run in the same process: each switches one safeguard off and must be caught by
the check named beside it in ``sched_hybrid.CONTROLS``. Skipped with ``KVCACHE_SKIP_VLLM_E2E=1``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.venv_run import run_script

SCENARIOS = [
    "layouts",
    "prefix_reuse",
    "prefix_reuse_async_scheduling",
    "preemption",
    "preemption_async_scheduling",
    "failed_load",
    "failed_load_async_scheduling",
]
CONTROLS = ["offload_first_group", "corrupt_mamba_state", "corrupt_restored_swa", "corrupt_restored_mamba"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hybrid") / "results.json"
    return run_script(vllm_python, "sched_hybrid.py", out, "--controls", timeout=1800)


def test_every_scenario_and_control_ran(results: dict[str, Any]) -> None:
    assert sorted(results["scenarios"]) == sorted(SCENARIOS)
    assert sorted(results["controls"]) == sorted(CONTROLS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results: dict[str, Any], name: str) -> None:
    result = results["scenarios"][name]
    assert result["ok"], result["error"]


@pytest.mark.parametrize("name", CONTROLS)
def test_control_is_caught(results: dict[str, Any], name: str) -> None:
    """The scenario fails with the safeguard off, and by the check that guards it."""
    result = results["controls"][name]
    assert result["caught"], result.get("error") or "the scenario passed without the safeguard"
