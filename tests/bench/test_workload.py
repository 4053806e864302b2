"""The workload benchmark: deterministic requests, derived numbers, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.bench.workload import RunResult, build_parser, main, make_requests
from kvcache.bench.workload_report import overhead, series, summarize


def test_requests_depend_only_on_the_seed_and_reuse_prefixes() -> None:
    args = build_parser().parse_args(["--requests", "50", "--system-prompt-tokens", "64"])
    a, b = make_requests(args), make_requests(args)
    assert a == b
    args.seed = 1
    assert make_requests(args) != a
    assert all(r.prompt[:64] == a[0].prompt[:64] for r in a)  # the shared system prompt
    assert any(r.conversation == a[0].conversation for r in a[1:])  # conversations continue
    assert all(len(r.prompt) + len(r.reply) <= args.num_blocks * args.block_size for r in a)


def test_rates_are_sums_over_sums() -> None:
    run = RunResult(
        False,
        seconds=2.0,
        requests=10,
        prompt_tokens=1000,
        lookup_s=[0.001] * 99 + [0.1],
        store_bytes=3_000_000_000,
        store_s=2.0,
        retrieve_bytes=1_000_000_000,
        retrieve_s=0.5,
    )
    run.windows = [
        {
            "t": 1.0,
            "requests": 5,
            "kvcache_lookup_requested_tokens_total": 100,
            "kvcache_lookup_l1_hit_tokens_total": 50,
            "kvcache_lookup_l2_hit_tokens_total": 25,
        },
        {
            "t": 2.0,
            "requests": 10,
            "kvcache_lookup_requested_tokens_total": 200,
            "kvcache_lookup_l1_hit_tokens_total": 150,
            "kvcache_lookup_l2_hit_tokens_total": 25,
        },
    ]
    run.final = run.windows[-1]
    s = summarize(run)
    assert (s["store_gb_per_s"], s["retrieve_gb_per_s"]) == (1.5, 2.0)
    assert (s["hit_rate_l1"], s["hit_rate_l2"], s["miss_rate"]) == (0.75, 0.125, 0.125)
    assert s["lookup_p99_ms"] == 100.0 and s["lookup_p50_ms"] == 1.0
    ser = series(run)
    assert ser["l1"] == [0.5, 1.0] and ser["l2"] == [0.25, 0.0] and ser["req_per_s"] == [5.0, 5.0]
    assert summarize(RunResult(True))["miss_rate"] == 0.0  # no division by zero


def test_overhead_uses_medians_pairs_and_daemon_cpu() -> None:
    def run(on: bool, repeat: int, seconds: float, cpu: float) -> RunResult:
        return RunResult(on, seconds=seconds, requests=100, daemon_cpu_s=cpu, repeat=repeat)

    runs = [run(False, 0, 1.0, 2.0), run(True, 0, 1.25, 2.2),  # pair 0: on 20% slower
            run(True, 1, 2.0, 2.4), run(False, 1, 2.0, 2.0),  # pair 1: equal (a slow spell)
            run(False, 2, 1.0, 2.0), run(True, 2, 0.8, 2.2)]  # fmt: skip
    o = overhead(runs)
    assert o["median"] == pytest.approx(0.2)  # medians: 80 vs 100 req/s
    assert o["pairs"] == pytest.approx([0.2, 0.0, -0.25]) and o["pairs_median"] == pytest.approx(0.0)
    assert o["best_of"] == pytest.approx(-0.25)
    assert o["daemon_cpu"] == pytest.approx(0.1)


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main(["--quick", "--requests", "30", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "workload.json").read_text())
    off, on = result["runs"]
    assert (off["kv_events"], on["kv_events"]) == (False, True)
    assert on["kv_event_batches_received"] > 0 and off["kv_event_batches_received"] == 0
    assert off["requests"] == 30 and off["hit_rate_l1"] > 0
    assert (out / "workload.png").stat().st_size > 10_000
    assert "kv_events_overhead" in result
    detail = result["kv_events_overhead_detail"]
    assert len(detail["pairs"]) == len(detail["requests_per_s"]["on"]) >= 1  # every off/on pair
