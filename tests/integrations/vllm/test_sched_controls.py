"""The scheduler harness's negative controls (``sched_controls.py``), run in the suite and so in CI.

Each control switches one safeguard of the connector or the client off and runs the harness
scenarios that guard it (``test_sched_harness.py`` runs them with every safeguard on): every one
must then fail, or the scenario would pass without proving its safeguard. All controls run in
one process in the vLLM venv (vLLM's import and the daemon zygote's start paid once; the list of
controls lives there too, as ``sched_controls.py`` imports vLLM). Skipped with
``KVCACHE_SKIP_VLLM_E2E=1``.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.venv_run import run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def verdicts(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    out = tmp_path_factory.mktemp("sched-controls") / "verdicts.json"
    # Exit status 1 with every verdict written: a control's scenario passed (checked per test).
    data: dict[str, dict[str, str]] = run_script(
        vllm_python, "sched_controls.py", out, timeout=1200, exit_codes=(0, 1)
    )
    return data


def test_every_control_fails_its_scenarios(verdicts: dict[str, dict[str, str]]) -> None:
    print("\n".join(f"{case}: {v['verdict']}: {v['detail']}" for case, v in verdicts.items()))
    assert verdicts, "no control ran"
    passed = [case for case, v in verdicts.items() if v["verdict"] == "passed"]
    assert not passed, f"scenarios that passed with their safeguard off (they prove nothing): {passed}"
    skipped = {case: v["detail"] for case, v in verdicts.items() if v["verdict"] == "skipped"}
    if skipped:
        pytest.skip(f"controls whose scenario skipped: {skipped}")
