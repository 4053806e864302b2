"""Smoke run of ``python -m kvcache.bench transfer`` at toy sizes: every row is produced
and written, the async rows included. Figures are read for shape, never for speed."""

from __future__ import annotations

import json
from pathlib import Path

from kvcache.bench.transfer import main


def test_transfer_bench_writes_kernel_and_async_rows(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    argv = ["--layouts", "NL_X_NB_BS_HS", "--layers", "2", "--heads", "1", "--head-size", "16"]
    argv += ["--mla-head-size", "32", "--blocks", "64", "--chunks", "2", "--reps", "1", "--async-batch", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["direction"] for r in data["results"]] == ["store", "load"]
    rows = data["async"]
    assert [r["direction"] for r in rows] == ["store", "load"]
    for r in rows:
        assert r["layout"] == "NL_X_TWO_NB_BS_NH_HS" and r["batch"] == 3
        assert r["bytes"] == 2 * 256 * 2 * 2 * 16 * 2  # chunks x tokens x K/V x layers x width x bf16
        assert r["submit_us_median"] > 0 and r["copy_ms_median"] > 0 and r["async_to_sync"] > 0


def test_no_async_skips_the_async_rows(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    argv = ["--layouts", "NL_X_NB_BS_HS", "--layers", "2", "--heads", "1", "--head-size", "16"]
    argv += ["--mla-head-size", "32", "--blocks", "64", "--chunks", "2", "--reps", "1", "--no-async"]
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["async"] == []


def test_dtypes_repeat_the_layout_rows_per_element_type(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    argv = ["--layouts", "NL_X_NB_BS_HS", "--layers", "2", "--heads", "1", "--head-size", "16"]
    argv += ["--mla-head-size", "32", "--blocks", "64", "--chunks", "2", "--reps", "1", "--no-async"]
    assert main([*argv, "--dtypes", "bf16,fp8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["direction"]) for r in rows] == [
        ("bfloat16", "store"), ("bfloat16", "load"), ("float8_e4m3fn", "store"), ("float8_e4m3fn", "load")
    ]  # fmt: skip
    assert rows[2]["bytes"] * 2 == rows[0]["bytes"]  # one byte an element instead of two
