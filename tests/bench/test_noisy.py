"""``python -m kvcache.bench noisy`` runs end to end on tiny floods and reports every figure."""

from __future__ import annotations

import argparse
import os

from kvcache.bench.noisy import run


def test_noisy_bench_reports_the_victims_ratios_and_the_attackers_refusals() -> None:
    # A bound long enough that no held await ends before the last one is sent (on a loaded
    # machine the attacker's process may take seconds to send 2,100 requests).
    ns = argparse.Namespace(floods="cpu,awaits,connections", requests=2100, connections=4, await_ms=8000,
                            samples=5, placement="split", json=True)  # fmt: skip
    own = os.sched_getaffinity(0)
    results = run(ns)
    assert os.sched_getaffinity(0) == own  # the bench gives the caller its cores back
    for op in ("retrieve", "lookup", "store"):
        assert 0 < results["base"][op]["p50_ms"] <= results["base"][op]["p99_ms"]
    awaits = results["awaits"]
    # 2,100 awaits against the default --max-awaiting-retrieves of 2,048: the rest refused.
    assert awaits["refused"] == 2100 - 2048
    assert awaits["late_s"] >= 0 and awaits["retrieve"]["p99_ratio"] > 0
    assert results["connections"]["refused"] == 0
    # Split placement: the attacker's process never runs on the daemon's cores.
    if len(os.sched_getaffinity(0)) >= 2:
        for kind in ("cpu", "awaits", "connections"):
            assert results[kind]["attacker_cpus"] and not set(results[kind]["attacker_cpus"]) & set(
                results["daemon_cpus"]
            )
    # No flood here stores: the victim's cold prompt is whole after each.
    assert all(results[kind]["cold_kept"] == 1.0 for kind in ("cpu", "awaits", "connections"))
    # The reference sends nothing: no refusal, and the victim measured beside it.
    assert results["cpu"]["refused"] == 0 and results["cpu"]["retrieve"]["p99_ratio"] > 0
    for kind in ("cpu", "awaits", "connections"):  # the daemon's memory within the operator guide's bound
        row = results[kind]
        assert row["daemon_cpu_s"] >= 0 and row["cpu_us_per_request"] >= 0
        assert row["rss_mib"] > 0 and row["rss_growth_mib"] <= row["bound_mib"], row
