"""``python -m kvcache.bench daemon`` runs end to end on tiny sizes and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.bench.daemon import main


def test_daemon_bench_reports_rtt_throughput_and_concurrency(tmp_path: Path) -> None:
    out = tmp_path / "daemon.json"
    argv = ["--layers", "2", "--heads", "2", "--head-size", "64", "--chunks", "4", "--reps", "1",
            "--lookups", "50", "--lookup-tokens", "256", "--clients", "2", "--client-rounds", "2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["what"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("ping ipc:// (floor)", "ping tcp:// (floor)", "lookup via daemon, ipc://",
                 "lookup via daemon, tcp://", "lookup in-process"):  # fmt: skip
        assert 0 < rows[name]["p50_us"] <= rows[name]["p99_us"]
    ratio = rows["lookup p50 ipc/tcp"]
    want = rows["lookup via daemon, ipc://"]["p50_us"] / rows["lookup via daemon, tcp://"]["p50_us"]
    assert ratio["ratio"] == pytest.approx(want) and ratio["target"] == 0.7
    for op in ("store GB/s", "retrieve GB/s"):
        assert rows[op]["daemon"] > 0 and rows[op]["in_process"] > 0 and rows[op]["ratio"] > 0
    conc = rows["2 concurrent clients"]
    assert conc["errors"] == 0 and conc["rounds"] == 4
