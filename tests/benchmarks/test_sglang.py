"""The SGLang benchmark: its arguments and figures here; a ``--quick`` run (slow) only where the
SGLang venv already exists (``.sglang-venv``, or ``KVCACHE_SGLANG_PYTHON``; never built here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sglang as bench
from tests.helpers import bench_quick_run

REPO = Path(__file__).resolve().parents[2]
SHIMS = REPO / "tests" / "integrations" / "sglang" / "cishim"


def test_quick_is_small_and_pages_come_in_whole_batches() -> None:
    quick = bench.parse_args(["--quick"])
    assert (quick.pages, quick.batch, quick.rounds, quick.warmup, quick.layers) == (64, 32, 1, 0, 2)
    full = bench.parse_args([])
    assert (full.pages, full.batch, full.rounds, full.warmup) == (512, 128, 3, 1)
    with pytest.raises(SystemExit):
        bench.parse_args(["--pages", "100", "--batch", "64"])


def test_ratios_are_per_round_kvcache_over_the_file_backend() -> None:
    figures = {
        "set_pages_per_s": {"kvcache in place": [200, 300], "kvcache staged": [100, 100],
                            "file layer_first": [100, 100], "file page_first": [50, 200]},
        "get_pages_per_s": {"kvcache in place": [400, 400], "kvcache staged": [90, 90],
                            "file layer_first": [100, 200], "file page_first": [90, 45]},
        "page_bytes": 65536,
    }  # fmt: skip
    s = bench.summarize(figures)
    in_place, staged = s["ratios"]["in place / file, layer_first"], s["ratios"]["staged / file, page_first"]
    assert in_place["set"]["values"] == [2.0, 3.0] and in_place["set"]["median"] == 2.5
    assert in_place["get"]["values"] == [4.0, 2.0] and in_place["get"]["median"] == 3.0
    assert staged["set"]["values"] == [2.0, 0.5] and staged["get"]["values"] == [1.0, 2.0]
    assert s["paths"]["kvcache in place"] == {"set": 250, "get": 400}
    text = bench.table(s, 65536)
    assert "pages of 64 KiB" in text and "in place / file, layer_first       2.50     3.00" in text


@pytest.mark.slow
@bench_quick_run
def test_quick_run(tmp_path: Path, sglang_python: str) -> None:
    """``--quick`` end to end (about a minute): a daemon, SGLang's pools, its file backend."""
    out = tmp_path / "sglang.json"
    argv = ["--quick", "--sglang-python", sglang_python, "--sglang-path", str(SHIMS),
            "--file-dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    for direction in ("set", "get"):
        for path in ("kvcache in place", "kvcache staged", "file layer_first", "file page_first"):
            assert len(result["figures"][f"{direction}_pages_per_s"][path]) == 1
            assert result["summary"]["paths"][path][direction] > 0
        assert set(result["summary"]["ratios"]) == set(bench.RATIOS)
