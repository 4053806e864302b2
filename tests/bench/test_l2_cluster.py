"""``python -m kvcache.bench l2 --redis-cluster`` runs end to end on tiny sizes against local
servers (one ``redis-server`` and a 3-master cluster) and reports every figure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcache.bench.storage import main_l2


def test_cluster_bench_reports_ratio_cpu_and_projection(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not found on PATH (Debian: apt-get install redis-server)")
    out = tmp_path / "l2_cluster.json"
    argv = ["--redis-cluster", "--layers", "1", "--heads", "2", "--head-size", "64", "--chunks", "6",
            "--reps", "1", "--workers", "1,2", "--json", str(out)]  # fmt: skip
    assert main_l2(argv) == 0
    rows = json.loads(out.read_text())["results"]
    phases = {(r["bench"], r["workers"]): r for r in rows if "GiBps" in r}
    for name in ("redis", "redis-cluster"):
        for op in ("store", "load"):
            for workers in (1, 2):
                row = phases[(f"l2_{name}_{op}", workers)]
                assert row["GiBps"] > 0 and row["wall_s"] > 0
                assert row["client_user_s"] + row["client_sys_s"] >= 0 and row["server_s"] >= 0
    ratios = {(r["bench"], r["workers"]): r for r in rows if "ratio" in r}
    for op in ("store", "load"):
        for workers in (1, 2):
            ratio = ratios[(f"l2_cluster_over_single_{op}", workers)]
            single, cluster = phases[(f"l2_redis_{op}", workers)], phases[(f"l2_redis-cluster_{op}", workers)]
            assert ratio["masters"] == 3
            assert ratio["ratio"] == pytest.approx(single["wall_s"] / cluster["wall_s"])
    (projection,) = [r for r in rows if r["bench"] == "l2_cluster_projection"]
    assert len(projection["keys_per_master"]) == 3 and sum(projection["keys_per_master"]) == 6
    assert projection["store_cluster_servers_GiBps"] > 0 and projection["load_one_client_GiBps"] > 0
