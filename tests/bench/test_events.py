"""Smoke test of ``python -m kvcache.bench events``: runs small, writes JSON, bound holds."""

from __future__ import annotations

import json
from pathlib import Path

from kvcache.bench.events import main


def test_events_benchmark_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "events.json"
    assert (
        main(["--events", "3000", "--overload-seconds", "0.2", "--queue-size", "500", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["publish"]["events"] == 3000 and result["publish"]["median_ns"] > 0
    assert result["dispatch"]["events_per_s"] > 0
    assert result["dispatch"]["subscriber_errors"] == 0
    overload = result["overload"]
    assert overload["bound_held"] and overload["max_queue_depth"] <= 500
    assert overload["dropped"] > 0  # 10x overload must drop, never block
    assert overload["accepted"] + overload["dropped"] == overload["offered"]
