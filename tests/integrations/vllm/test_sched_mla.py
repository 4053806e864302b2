"""An MLA model at tensor parallelism 2 under vLLM's scheduler: ``sched_mla.py`` in the vLLM venv.

Each chunk is stored once for both ranks (the daemon's L1 counts it once, the second rank
issues no store), both ranks load it byte-exact, another TP size and another key scope never
read it, and a failed writer leaves a miss. The controls run in the same process: each
switches one safeguard off and must be caught by the check named beside it in
``sched_mla.CONTROLS``. Skipped with ``KVCACHE_SKIP_VLLM_E2E=1``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.venv_run import run_script

SCENARIOS = ["stored_once", "stored_once_async_scheduling", "writer_fails", "other_scope_rank"]
CONTROLS = ["every_rank_stores", "per_rank_scopes"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mla") / "results.json"
    return run_script(vllm_python, "sched_mla.py", out, "--controls", timeout=900)


def test_every_scenario_and_control_ran(results: dict[str, Any]) -> None:
    assert sorted(results["scenarios"]) == sorted(SCENARIOS)
    assert sorted(results["controls"]) == sorted(CONTROLS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results: dict[str, Any], name: str) -> None:
    result = results["scenarios"][name]
    print(name, result.get("facts"))
    assert result["ok"], result["error"]


@pytest.mark.parametrize("name", CONTROLS)
def test_control_is_caught(results: dict[str, Any], name: str) -> None:
    """The scenario fails with the safeguard off, and by the check that guards it."""
    result = results["controls"][name]
    assert result["caught"], result.get("error") or "the scenario passed without the safeguard"
