"""``python -m benchmarks.vllm_shared`` without vLLM: arguments, sizes, prompts, the figures.

A real run needs the vLLM venv and minutes: ``test_quick_run`` does one, by hand
(``KVCACHE_BENCH_QUICK_RUNS=1``), never in CI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vllm_shared as bench
from benchmarks.vllm_messages import ModelSpec, SharedPrefix
from benchmarks.vllm_shared_driver import prompts
from benchmarks.vllm_shared_report import COUNTERS, summarize, table
from tests.helpers import bench_quick_run


def test_arguments_quick_and_refusals() -> None:
    a = bench.parse_args([])
    assert (a.rounds, a.requests, a.prefix, a.modes) == (5, 8, 4096, ["none", "connector", "window-1"])
    q = bench.parse_args(["--quick", "--requests", "4"])
    assert (q.rounds, q.requests, q.prefix, q.layers) == (2, 4, 4096, 4)
    assert bench.parse_args(["--quick", "--rounds", "3"]).rounds == 3
    for argv in (["--modes", "none,bogus"], ["--modes", "connector"], ["--modes", "none,none"],
                 ["--requests", "1"], ["--prefix", "100"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_sizes_hold_the_group_in_blocks_of_its_own() -> None:
    a = bench.parse_args([])
    model = ModelSpec()  # 8 KiB a token
    s = bench.sizes(a, model)
    group = 8 * (4096 + 32 + 32) * model.kv_bytes_per_token() / (1 << 20)
    assert group < s["kv_cache_mb"] < 1.5 * group
    per_round = 2 * 2 * 4096 * model.kv_bytes_per_token() / (1 << 30)  # two connector modes, two prefixes
    assert s["l1_gb"] > 2 * per_round and s["disk_gb"] > 6 * per_round  # 5 rounds + the warm-up
    assert bench.sizes(bench.parse_args(["--kv-cache-mb", "99"]), model)["kv_cache_mb"] == 99


def test_prompts_share_the_prefix_and_differ_in_their_tails() -> None:
    group = prompts(SharedPrefix(7, 512, 16, requests=8), 1000)
    assert len(group) == 8 and all(len(p) == 528 for p in group)
    assert len({tuple(p[:512]) for p in group}) == 1 and len({tuple(p[512:]) for p in group}) == 8
    (stored,) = prompts(SharedPrefix(7, 512, 16, store=True), 1000)
    assert stored[:512] == group[0][:512] and stored[512:] not in [p[512:] for p in group]
    assert prompts(SharedPrefix(7, 512, 16, requests=8), 1000) == group  # every mode: the same tokens
    assert prompts(SharedPrefix(8, 512, 16), 1000)[0][:512] != group[0][:512]


def _run(ttft_ms: list[float], cached: int, firsts: list[int], reads: float = 16,
         l1: float = 0) -> dict[str, Any]:  # fmt: skip
    daemon = dict.fromkeys(COUNTERS, 0.0)
    if cached:
        n = len(ttft_ms)
        daemon.update({"kvcache_lookup_requests_total": n, "kvcache_l2_load_chunks_total": reads,
                       "kvcache_lookup_l1_hit_tokens_total": l1, "kvcache_lookup_l2_hit_tokens_total": 4096,
                       "kvcache_retrieve_requests_total": n, "kvcache_offload_load_seconds_total": 0.02 * n,
                       "kvcache_retrieve_duration_seconds_sum": 0.1 * n})  # fmt: skip
    return {"ttft_s": [t / 1e3 for t in ttft_ms], "cached_tokens": [cached] * len(ttft_ms),
            "prompt_tokens": [4128] * len(ttft_ms), "first_tokens": firsts, "seconds": 1.0,
            "calls": {"get_finished": (3, 0.002)} if cached else {}, "stats": {}, "step_s": [0.01] * 3,
            "daemon": daemon}  # fmt: skip


def _round(lone: float, group: list[float], none_group: list[float], **bad: Any) -> dict[str, Any]:
    firsts = list(range(4))
    return {"registrations": [1000], "modes": {
        "none": {"lone": _run([10 * lone], 0, [9]), "group": _run(none_group, 0, firsts)},
        "connector": {"lone": _run([lone], 4096, [9], l1=bad.get("l1", 0)),
                      "group": _run(group, bad.get("cached", 4096), bad.get("firsts", firsts),
                                    reads=bad.get("reads", 16))},
    }}  # fmt: skip


def test_figures_are_group_p50_over_lone_per_round() -> None:
    rounds = [
        _round(40, [44, 48, 52, 80], [400, 800, 800, 800]),  # p50 50 ms: 1.25
        _round(20, [30, 30, 30, 30], [400, 600, 600, 600]),  # 1.5
        _round(40, [40, 44, 48, 60], [400, 800, 800, 800]),
    ]  # 1.15
    s = summarize(rounds, 4, 4096, 256, {"connector"})
    c = s["modes"]["connector"]
    assert c["group_over_lone"]["values"] == pytest.approx([1.25, 1.5, 1.15])
    assert c["group_over_lone"]["median"] == pytest.approx(1.25) and c["group_over_lone"]["met"]
    assert c["group_p50_ms"]["values"] == pytest.approx([50, 30, 46]) and c["group_max_ms"]["max"] == 80
    assert c["group_cached_tokens"] == [4096] and c["group_computed_tokens"] == [32]
    assert c["daemon"]["group"]["l2_load_chunks"] == 16 and c["group_get_finished_ms"] == pytest.approx(2)
    assert "target" not in s["modes"]["none"]["group_over_lone"]
    assert s["between"]["none / connector"]["values"] == pytest.approx([16, 20, 800 / 46])
    assert s["valid"], s["problems"]
    text = table(s, {"connector": "the defaults"})
    assert "group p50 / lone: 1.250  [1.150 .. 1.500]  (target <= 1.3: met)" in text
    assert "daemon, group: disk reads 16 chunks" in text and "the defaults" in text
    assert "100.0 ms each from start to end, 20.0 ms each copying" in text
    slow = summarize([_round(20, [30] * 4, [400] * 4)], 4, 4096, 256, {"connector"})
    assert not slow["modes"]["connector"]["group_over_lone"]["met"] and "MISSED" in table(slow, {})


def test_runs_that_did_not_measure_the_question_are_flagged() -> None:
    bad = _round(40, [44] * 4, [400] * 4, l1=4096, reads=0, cached=2048, firsts=[1, 2, 3, 5])
    bad["registrations"] = [1000, 1000]
    s = summarize([bad], 4, 4096, 256, {"connector"})
    assert s["problems"] == [
        "round 1: the modes' first tokens differ (group)",
        "round 1: an engine registered again during the timed runs",
        "round 1: connector lone: the prefix was in L1",
        "round 1: connector group: nothing was read from disk",
        "round 1: connector group: loaded 2048 of 4096 prefix tokens",
    ]
    assert not s["valid"] and "PROBLEM: round 1: connector lone: the prefix was in L1" in table(s, {})


@pytest.mark.slow
@bench_quick_run
def test_quick_run(tmp_path: Path, vllm_python: str) -> None:
    """``--quick`` end to end (the 4-layer model, 2 rounds and a warm-up; minutes on 2 cores)."""
    out = tmp_path / "shared.json"
    assert bench.main(["--quick", "--vllm-python", vllm_python, "--work-dir", str(tmp_path),
                       "--out", str(out)]) == 0  # fmt: skip
    figures = json.loads(out.read_text())["figures"]
    assert figures["valid"], figures["problems"]
    for mode in ("connector", "window-1"):
        assert figures["modes"][mode]["group_cached_tokens"] == [4096]
        assert figures["modes"][mode]["daemon"]["lone"]["l2_load_chunks"] >= 16
