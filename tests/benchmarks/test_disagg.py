"""The disaggregation benchmark: arguments, the workload, its streaming client against a real
small HTTP server, the figures; and a ``--quick`` run end to end where a vLLM venv exists
(it is never built here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import disagg
from benchmarks.disagg_client import Stream, Workload, run
from tests.helpers import bench_quick_run
from tests.integrations.vllm.proxy.upstream import Call, FakeVllm


def test_quick_overrides_only_what_the_command_line_left_alone() -> None:
    a = disagg.parse_args(["--quick", "--decoders", "3"])
    assert (a.rounds, a.decoders, a.long_prompt, a.layers, a.roles) == (1, 3, 512, 2, "split")
    assert disagg.parse_args(["--roles", "both"]).roles == "both"
    with pytest.raises(SystemExit):
        disagg.parse_args(["--roles", "kv_producer"])
    with pytest.raises(SystemExit):
        disagg.parse_args(["--long-prompts", "0"])


def test_the_workload_depends_only_on_its_seed() -> None:
    kw = {"decoders": 2, "decode_prompt": 64, "decode_tokens": 8, "long_prompts": 3, "long_prompt": 512,
          "long_tokens": 4, "gap_s": 0.0, "vocab": 1000}  # fmt: skip
    w = Workload.make(1, **kw)  # type: ignore[arg-type]
    assert w == Workload.make(1, **kw) and w != Workload.make(2, **kw)  # type: ignore[arg-type]
    assert [len(p) for p in w.long_prompts] == [517, 530, 543]  # odd: partial last chunk and block
    assert all(3 <= t < 1000 for p in w.decoders + w.long_prompts for t in p)


def test_no_two_rounds_send_the_same_prompts() -> None:
    a = disagg.parse_args(["--rounds", "5", "--warmup", "2", "--decoders", "1", "--long-prompts", "1"])
    warm, timed = disagg.seeds(a)
    prompts = [tuple(disagg.workload(a, s, 1000).long_prompts[0]) for s in warm + timed]
    assert len(warm) == 2 and len(timed) == 5 and len(set(prompts)) == 7


def test_the_client_times_every_event_and_records_failures() -> None:
    calls: list[Call] = []
    server = FakeVllm("s", calls)
    try:
        w = Workload([[5, 6]], 4, [[7, 8, 9], [10]], 2, 0.0)
        streams = run(server.url, w, 30)
        assert [s.kind for s in streams] == ["decode", "long", "long"]
        assert all(len(s.times) == 3 and s.error is None and s.ttft_s is not None for s in streams)
        assert streams[1].text == "s-0s-1s-2" and len(streams[0].gaps_s()) == 2
        assert calls[0].body["prompt"] == [5, 6]  # the decoder first; the long ones race (gap 0)
        assert sorted(c.body["prompt"] for c in calls[1:]) == [[7, 8, 9], [10]]
        assert all(c.body["stream"] and c.body["ignore_eos"] and c.body["temperature"] == 0 for c in calls)
        server.script.die_after = 1
        (broken,) = run(server.url, Workload([], 4, [[1]], 2, 0.0), 30)
        assert broken.error and len(broken.times) == 1
        server.script.die_after, server.script.error = None, (400, b'{"error": "bad"}')
        (refused,) = run(server.url, Workload([], 4, [[1]], 2, 0.0), 30)
        assert refused.error is not None and refused.error.startswith("HTTP 400")
    finally:
        server.close()


def _streams(ttft: list[float], gap: float, text: str = "t") -> list[dict[str, object]]:
    out = [Stream("decode", 0.0, [1.0, 1.0 + gap, 1.0 + 2 * gap], text)]
    out += [Stream("long", 10.0, [10.0 + t], text, prefill_s=t / 2) for t in ttft]
    return [vars(s) for s in out]


def test_figures_pool_the_rounds_and_compare_split_with_single() -> None:
    single = {"streams": _streams([0.1, 0.1], 0.01), "local_compute_tokens": 1200, "loaded_tokens": 0}
    raw = {"rounds": [
        {"split": {"streams": _streams([0.2, 0.4], 0.02), "local_compute_tokens": 30, "loaded_tokens": 900},
         "single": single},
        {"split": {"streams": _streams([0.2, 0.2], 0.02, "x"), "local_compute_tokens": 0,
                   "loaded_tokens": 900},
         "single": single},
    ]}  # fmt: skip
    fig = disagg.summarize(raw)
    split, single = fig["targets"]["split"], fig["targets"]["single"]
    assert split["ttft_ms"] == {"p50": pytest.approx(200), "p99": pytest.approx(400), "n": 4}
    assert single["itl_ms"]["p50"] == pytest.approx(10) and single["itl_ms"]["n"] == 4
    assert split["prefill_call_ms"]["p50"] == pytest.approx(100)
    assert fig["ratios"]["ttft_ms p50"] == pytest.approx(2.0) and fig["ratios"][
        "itl_ms p99"
    ] == pytest.approx(2.0)
    assert split["computed_prompt_tokens_per_request"] == pytest.approx(30 / 6)
    assert split["loaded_tokens_per_request"] == pytest.approx(300)
    assert fig["outputs_agree"] == [3, 6] and fig["problems"] == []
    text = disagg.table(raw, fig)
    assert "long-prompt TTFT p50 ms" in text and "3/6 requests" in text and "the prefill call, p50" in text

    raw["rounds"][0]["split"]["streams"][1] = vars(Stream("long", 0.0, [], "", "HTTP 502: gone"))
    fig = disagg.summarize(raw)
    assert fig["problems"] == ["split: HTTP 502: gone", "split: a long prompt produced no token"]
    assert "PROBLEM: split: HTTP 502: gone" in disagg.table(raw, fig)


@pytest.mark.slow
@bench_quick_run
def test_quick_run(tmp_path: Path, vllm_python: str) -> None:
    """``--quick`` end to end: a daemon, three vLLM servers and the proxy (minutes on 2 cores)."""
    out = tmp_path / "disagg.json"
    assert disagg.main(["--quick", "--vllm-python", vllm_python, "--work-dir", str(tmp_path),
                        "--out", str(out)]) == 0  # fmt: skip
    fig = json.loads(out.read_text())["figures"]
    assert fig["problems"] == [], fig["problems"]
    for target in ("split", "single"):
        assert fig["targets"][target]["ttft_ms"]["n"] == 2 and fig["targets"][target]["itl_ms"]["n"] > 0
    assert fig["targets"]["single"]["computed_prompt_tokens_per_request"] > 0  # the metric is read
