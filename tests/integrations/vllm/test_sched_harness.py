"""The connector under vLLM's own scheduler: ``sched_scenarios.py`` run in the vLLM venv.

vLLM's real ``Scheduler`` and ``AsyncScheduler`` drive ``KVCacheConnector`` (scheduler half) and
a worker ``KVCacheConnector`` moving real bytes through real daemons, stepped in vLLM's order,
with a model-free forward whose KV is a function of the whole prefix (``sched_model.py``,
stepped by ``sched_engine.py``; daemons and the reader engine in ``sched_world.py``).
Every scenario checks the tokens against an oracle, that no step computed on a wrong context
vLLM was not told about, and that every chunk the daemon serves equals the oracle's bytes;
after every step, that no request is in limbo, and that every run ends within a wall-clock
bound (``sched_invariants.py``). What each scenario proves is in its docstring in
``sched_scenarios.py``, ``sched_loads.py`` and ``sched_failures.py``.

The scenarios run in one process (vLLM's import dominates a process's start), each with
fresh daemons forked from one zygote (``kvcache.testing.daemon_zygote``: no torch import per
daemon): the fixture runs them all once with asynchronous loads (the default) and once with
``async_loads: false`` (``SYNC_LOADS``: all but those that need a load to outlive its step,
and the one that runs vLLM alone), and each test reads its scenario's result. Skipped with
``KVCACHE_SKIP_VLLM_E2E=1``.
``sched_controls.py`` (run by ``test_sched_controls.py``) switches each safeguard off in turn and
checks that its scenarios then fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.vllm.venv_run import run_script

SCENARIOS = [
    "shared_prefixes_sync",
    "shared_prefixes_async",
    "failed_load_sync",
    "failed_load_async",
    "lora",
    "multimodal",
    "prompt_embeds",
    "preemption",
    "batched_lookups",
    "shared_load",
    "shared_load_async",
    "daemon_killed",
    "stalled_daemon",
    "stalled_redis_l2",
    "store_release_async",
    "store_release_sync",
    "late_loads_sync",
    "late_loads_async",
    "abort_while_loading_sync",
    "abort_while_loading_async",
    "abort_resumed_while_loading",
    "loading_through_preemptions",
    "preempted_store",
    "slow_l2",
    "daemon_lost_while_loading",
    "partial_batch_failure",
    "preempted_resume_fails",
    "vllm_failed_load_fact",
    "lone_loads",
    "shared_blocks_of_a_failed_load",
    "store_release_abort_async",
    "shared_leader_aborted",
    "shared_leader_fails",
    "l2_read_errors",
    "restart_while_loading",
    "block_tables_at_boundaries",
    "block_tables_at_boundaries_async",
]
NEED_ASYNC_LOADS = {  # and those run once
    "late_loads_sync",
    "late_loads_async",
    "abort_while_loading_sync",
    "abort_while_loading_async",
    "abort_resumed_while_loading",
    "loading_through_preemptions",
    "vllm_failed_load_fact",  # vLLM alone: once
    "lone_loads",  # the default's choice between the two
    "shared_leader_aborted",  # nobody waits for another's load with synchronous loads
    "shared_leader_fails",
}
SYNC_LOADS = [n for n in SCENARIOS if n not in NEED_ASYNC_LOADS]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both modes in one process (vLLM's import and the daemon zygote's start paid once):
    ``async_loads`` (the default) runs every scenario, ``sync_loads`` runs ``SYNC_LOADS``."""
    out = tmp_path_factory.mktemp("sched") / "results.json"
    return run_script(
        vllm_python, "sched_scenarios.py", out, "--modes", "async_loads", "sync_loads", timeout=900
    )


@pytest.fixture(scope="module")
def results(runs: dict[str, Any]) -> dict[str, Any]:
    """Every scenario, with the connector's default asynchronous loads."""
    return runs.get("async_loads", {})


@pytest.fixture(scope="module")
def sync_loads_results(runs: dict[str, Any]) -> dict[str, Any]:
    """``SYNC_LOADS``, with ``async_loads: false``."""
    return runs.get("sync_loads", {})


def test_every_scenario_ran(results: dict[str, Any], sync_loads_results: dict[str, Any]) -> None:
    assert sorted(results) == sorted(SCENARIOS)
    assert sorted(sync_loads_results) == sorted(SYNC_LOADS)


def _check(results: dict[str, Any], name: str) -> None:
    result = results.get(name)
    assert result is not None, f"{name} did not run"
    print(f"{name}: {result['seconds']} s, {result['facts']}")
    if result.get("skipped"):
        pytest.skip(result["skipped"])
    assert result["ok"], result["error"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results: dict[str, Any], name: str) -> None:
    _check(results, name)


@pytest.mark.parametrize("name", SYNC_LOADS)
def test_scenario_with_sync_loads(sync_loads_results: dict[str, Any], name: str) -> None:
    _check(sync_loads_results, name)
