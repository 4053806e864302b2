"""The vLLM benchmark without vLLM: arguments, modes, the pipe to an engine, the figures.

A real run needs the vLLM venv and minutes; ``test_quick_run`` (slow) does a short one, and
only where the venv already exists (it is never built here).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from benchmarks import vllm as bench
from benchmarks.vllm_engines import EngineProcess
from benchmarks.vllm_messages import Decode, DecodeResult, EngineSpec, ModelSpec, Ready, Ttft, TtftResult
from benchmarks.vllm_report import (
    connector_ms_per_step,
    cpu_per_step,
    summarize_decode,
    summarize_ttft,
    table,
)
from tests.helpers import bench_quick_run

REPO = Path(__file__).resolve().parents[2]


def test_quick_overrides_only_what_the_command_line_left_alone() -> None:
    a = bench.parse_args(["--quick", "--pairs", "5"])
    assert a.pairs == 5 and a.layers == 2 and a.decode_tokens == 256
    full = bench.parse_args([])
    assert (full.pairs, full.layers, full.hidden) == (7, 4, 512)
    assert (full.decode_tokens, full.ttft_prefix) == (1024, 2048)
    assert full.decode_modes == ["none", "connector"]
    assert full.ttft_modes == ["connector", "sync-loads", "none"]
    assert bench.parse_args(["--ttft-modes", ""]).ttft_modes == []


@pytest.mark.parametrize("argv", [["--decode-modes", "none,bogus"], ["--ttft-modes", "connector"]])
def test_bad_modes_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_a_mode_with_a_key_the_connector_lacks_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench.MODES, "future", bench.Mode({"no_such_key": 1}, "a key from the future"))
    assert bench.unavailable("none") is None and bench.unavailable("connector") is None
    assert "no_such_key" in (bench.unavailable("future") or "")


def test_rotation_puts_every_mode_in_every_position() -> None:
    modes = ["a", "b", "c"]
    orders = [bench._rotated(modes, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [bench._rotated(["x", "y"], r) for r in range(2)] == [["x", "y"], ["y", "x"]]


def test_messages_cross_the_pipe_as_one_json_line() -> None:
    spec = EngineSpec(model_dir="/m", model=ModelSpec(layers=2), connector={"async_stores": False})
    assert msgspec.json.decode(msgspec.json.encode(spec), type=EngineSpec) == spec
    for cmd in (Decode(1, 4, 64, 512), Ttft(2, 2048, 64)):
        line = msgspec.json.encode(cmd)
        assert b"\n" not in line and msgspec.json.decode(line, type=bench.Command) == cmd  # type: ignore[arg-type]
    assert ModelSpec().kv_bytes_per_token() == 2 * 4 * 4 * 64 * 4


FAKE_DRIVER = """
import os, sys, time, msgspec
from benchmarks.vllm_messages import *
fd = int(sys.argv[sys.argv.index("--reply-fd") + 1])
out = os.fdopen(fd, "wb", buffering=0)
print("vLLM logs go to stdout", flush=True)
out.write(msgspec.json.encode(Ready(0.1, 1, False, "/k")) + b"\\n")
dec = msgspec.json.Decoder(Command)
for line in sys.stdin.buffer:
    cmd = dec.decode(line)
    if isinstance(cmd, Quit):
        break
    if cmd.seed == 1:
        out.write(msgspec.json.encode(Failed("boom")) + b"\\n")
    elif cmd.seed == 2:
        time.sleep(30)  # on purpose: a child that never answers (the reply deadline is tested)
    elif cmd.seed == 3:
        sys.exit(4)
    else:
        out.write(msgspec.json.encode(TtftResult(0.5, 7, 9, 0.1, {}, {})) + b"\\n")
"""


def test_engine_process_pipe_failures_and_deadlines(tmp_path: Path) -> None:
    """The plumbing against a stand-in driver: replies, a Failed reply, a silent engine, a dead one."""
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_DRIVER))
    fake.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    spec = EngineSpec(model_dir="/m", model=ModelSpec(), connector=None)
    e = EngineProcess(str(fake), spec, env, tmp_path / "engine.log")
    try:
        assert e.reply(30) == Ready(0.1, 1, False, "/k")
        assert e.ask(Ttft(0, 1, 1), 30) == TtftResult(0.5, 7, 9, 0.1, {}, {})
        with pytest.raises(RuntimeError, match="boom"):
            e.ask(Ttft(1, 1, 1), 30)
        with pytest.raises(TimeoutError):
            e.ask(Ttft(2, 1, 1), 0.5)
    finally:
        e.close(timeout_s=1)  # stuck in its sleep: killed
    assert "vLLM logs go to stdout" in (tmp_path / "engine.log").read_text()
    e = EngineProcess(str(fake), spec, env, tmp_path / "engine.log")
    try:
        e.reply(30)
        with pytest.raises(RuntimeError, match="exited"):
            e.ask(Ttft(3, 1, 1), 30)
    finally:
        e.close()


def _decode(rate: float, step_ms: float, digest: str = "d", calls: bool = False,
            stats: dict[str, float] | None = None) -> DecodeResult:  # fmt: skip
    """100 decode tokens at ``rate`` tokens/s, 10 steps of ``step_ms``."""
    timed = {"wait_for_save": (10, 0.002), "build_connector_meta": (10, 0.001)} if calls else {}
    if stats is None:
        stats = {"store_tokens": 512} if calls else {}
    return DecodeResult(generated=104, seconds=100 / rate + 0.01, decode_tokens=100,
                        decode_seconds=100 / rate, step_s=[step_ms / 1e3] * 10, settle_s=0.001,
                        digest=digest, calls=timed, stats=stats)  # fmt: skip


def test_decode_figures_are_per_pair_ratios_and_their_median() -> None:
    rounds = [
        {"none": _decode(100, 5.0), "connector": _decode(97, 5.1, calls=True)},
        {"none": _decode(50, 9.0), "connector": _decode(49, 9.5, calls=True)},  # a loaded spell: both slow
        {"none": _decode(100, 5.0), "connector": _decode(90, 5.5, calls=True)},
    ]
    s = summarize_decode(rounds, "none")
    r = s["ratios"]["connector"]
    assert r["decode_tokens_per_s"]["values"] == pytest.approx([0.97, 0.98, 0.90])
    assert r["decode_tokens_per_s"]["median"] == pytest.approx(0.97) and r["met"]
    assert r["decode_time"]["values"] == pytest.approx([1 / 0.97, 1 / 0.98, 1 / 0.90])
    assert not r["time_met"]  # 1.031 > 1.03: the decode-time target is the stricter one
    assert summarize_decode(rounds, "none", time_target=1.04)["ratios"]["connector"]["time_met"]
    assert (r["decode_tokens_per_s"]["min"], r["decode_tokens_per_s"]["max"]) == pytest.approx((0.90, 0.98))
    assert r["step_median"]["values"] == pytest.approx([5.1 / 5.0, 9.5 / 9.0, 5.5 / 5.0])
    assert r["step_median"]["median"] == pytest.approx(9.5 / 9.0)
    assert s["modes"]["none"]["decode_tokens_per_s"]["median"] == pytest.approx(100)
    assert s["modes"]["connector"]["connector_ms_per_step"] == pytest.approx(
        {"build_connector_meta": 0.1, "wait_for_save": 0.2, "total": 0.3}
    )
    assert s["modes"]["connector"]["connector_stats"]["store_tokens"] == 3 * 512
    assert s["tokens_agree"] and s["valid"]
    text = table({"decode": s}, {"none": "none: alone"})
    assert "0.970  [0.900 .. 0.980] (target >= 0.95: met)" in text and "none: alone" in text
    assert "connector / none decode time: per pair 1.031 1.020 1.111" in text
    assert "1.031  [1.020 .. 1.111] (target <= 1.03: MISSED)" in text

    slow = [{"none": _decode(100, 5.0), "connector": _decode(90, 5.5, calls=True)}]
    assert not summarize_decode(slow, "none")["ratios"]["connector"]["met"]
    assert "MISSED" in table({"decode": summarize_decode(slow, "none")}, {})


def test_decode_runs_that_did_not_do_the_work_are_flagged() -> None:
    bad = [{"none": _decode(100, 5.0, digest="x"),
            "connector": _decode(100, 5.0, digest="y", calls=True, stats={"store_failures": 3})}]  # fmt: skip
    s = summarize_decode(bad, "none")
    assert not s["valid"] and not s["tokens_agree"]
    assert s["problems"] == ["the modes generated different tokens", "connector: nothing was stored",
                             "connector: 3 stores failed"]  # fmt: skip
    assert "PROBLEM: connector: 3 stores failed" in table({"decode": s}, {})
    plumbing = [{"none": _decode(100, 5.0), "no-traffic": _decode(99, 5.0, calls=True, stats={})}]
    assert summarize_decode(plumbing, "none", storing=set())["valid"]  # a mode told not to store
    assert not summarize_decode(plumbing, "none")["valid"]


def test_the_noop_connector_mode_loads_another_class_and_is_not_expected_to_store() -> None:
    """``noop`` (vLLM's connector plumbing alone) names its own class, and a run of it that
    stored nothing is no problem: only our connector's modes must store."""
    noop = bench.MODES["noop"]
    assert noop.connector_class == "benchmarks.vllm_noop:NoopConnector"
    assert bench.MODES["connector"].connector_class == "kvcache.integrations.vllm:KVCacheConnector"
    a = bench.parse_args(["--decode-modes", "none,noop,connector", "--ttft-modes", ""])
    rnd = {"none": _decode(100, 5.0), "noop": _decode(99, 5.0, calls=True, stats={}),
           "connector": _decode(98, 5.0, calls=True)}  # fmt: skip
    raw = {"decode": [msgspec.to_builtins(rnd)], "ttft": [], "daemon_cpu_s": {"decode": [], "ttft": []}}
    assert bench.summarize(a, raw)["decode"]["problems"] == []
    rnd["connector"] = _decode(98, 5.0, calls=True, stats={})  # ours stored nothing: flagged
    raw["decode"] = [msgspec.to_builtins(rnd)]
    assert bench.summarize(a, raw)["decode"]["problems"] == ["connector: nothing was stored"]


def _ttft(ms: float, cached: int, first: int = 5, calls: bool = True) -> TtftResult:
    steps = [0.008, ms / 1e3 - 0.008] if calls else [ms / 1e3]  # two steps with a connector
    timed = {"start_load_kv": (1, 0.004)} if calls else {}
    return TtftResult(ttft_s=ms / 1e3, cached_tokens=cached, first_token=first, store_s=0.2, calls=timed,
                      stats={}, step_s=steps)  # fmt: skip


def test_ttft_ratios_compare_the_default_with_sync_loads_and_recompute() -> None:
    rounds = [
        {"connector": _ttft(30, 2048), "sync-loads": _ttft(40, 2048), "none": _ttft(300, 0, calls=False)},
        {"connector": _ttft(60, 2048), "sync-loads": _ttft(50, 2048), "none": _ttft(600, 0, calls=False)},
        {"connector": _ttft(20, 2048), "sync-loads": _ttft(40, 2048), "none": _ttft(200, 0, calls=False)},
    ]
    s = summarize_ttft(rounds, "connector", "sync-loads")
    sync, none = s["ratios"]["sync-loads"], s["ratios"]["none"]
    assert sync["values"] == pytest.approx([0.75, 1.2, 0.5]) and sync["median"] == pytest.approx(0.75)
    assert sync["met"] and sync["target"] == 1.0
    assert none["median"] == pytest.approx(0.1) and "target" not in none
    assert s["modes"]["connector"]["ttft_ms"]["median"] == pytest.approx(30)
    assert s["modes"]["connector"]["start_load_kv_ms"] == pytest.approx(4)
    assert s["modes"]["connector"]["steps"] == 2 and s["modes"]["none"]["steps"] == 1
    assert s["modes"]["connector"]["step_max_ms"]["median"] == pytest.approx(22)
    assert s["valid"]
    text = table({"ttft": s}, {})
    assert "connector / sync-loads" in text and "(target <= 1.0: met)" in text and "B alone" in text
    assert "while 4 requests decode" in table({"ttft": {**s, "busy": 4}}, {})

    nothing_loaded = [{"connector": _ttft(30, 0), "none": _ttft(30, 2048, first=6, calls=False)}]
    bad = summarize_ttft(nothing_loaded, "connector", None)
    assert bad["problems"] == [
        "the modes' first tokens differ",
        "connector: B loaded 0 tokens, 0 loads failed",
        "none: B found 2048 tokens in vLLM's prefix cache",
    ]


def test_where_a_step_goes_splits_the_stepping_thread_from_the_rest() -> None:
    r = DecodeResult(generated=10, seconds=1.0, decode_tokens=8, decode_seconds=0.9, step_s=[0.01] * 100,
                     settle_s=0.0, digest="d", calls={}, stats={}, cpu_s=1.2, main_cpu_s=0.8,
                     main_preempted=50, page_faults=300)  # fmt: skip
    assert cpu_per_step(r) == pytest.approx({"main_cpu": 8.0, "main_off_cpu": 2.0, "other_threads_cpu": 4.0,
                                             "main_preempted": 0.5, "page_faults": 3.0})  # fmt: skip
    rounds = [{"none": r, "connector": r}, {"none": r, "connector": r}]
    daemon = [{"none": 0.0, "connector": 0.3}, {"none": 0.1, "connector": 0.5}]
    s = summarize_decode(rounds, "none", storing=set(), daemon_cpu=daemon)
    assert s["modes"]["connector"]["daemon_cpu_s"] == pytest.approx(0.4)
    assert s["ratios"]["connector"]["main_cpu_per_step"]["values"] == pytest.approx([1.0, 1.0])
    assert s["modes"]["none"]["cpu_ms_per_step"]["main_off_cpu"] == pytest.approx(2.0)


def test_connector_time_per_step() -> None:
    assert connector_ms_per_step({"a": (4, 0.004), "b": (2, 0.002)}, 4) == {"a": 1.0, "b": 0.5, "total": 1.5}
    assert connector_ms_per_step({}, 0) == {"total": 0.0}


@pytest.mark.slow
@bench_quick_run
def test_quick_run(tmp_path: Path, vllm_python: str) -> None:
    """``--quick`` end to end on the toy model (about 30 s)."""
    out = tmp_path / "vllm.json"
    assert bench.main(["--quick", "--engines", "session", "--vllm-python", vllm_python, "--work-dir",
                       str(tmp_path), "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    decode, ttft = result["figures"]["decode"], result["figures"]["ttft"]
    assert decode["valid"] and ttft["valid"], (decode["problems"], ttft["problems"])
    assert len(decode["ratios"]["connector"]["decode_tokens_per_s"]["values"]) == 2
    assert ttft["modes"]["connector"]["cached_tokens"] == [512, 512]
    assert ttft["modes"]["none"]["cached_tokens"] == [0, 0]
