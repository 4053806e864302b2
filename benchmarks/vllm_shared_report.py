"""The figures of ``python -m benchmarks.vllm_shared``, derived from its raw rounds.

Separate from the run so that every figure comes from one place and is testable without vLLM.
Ratios are within one round (the runs seconds apart): each mode's group TTFT p50 over its own
lone request's, and one mode's group p50 over another's; their medians over the rounds are
the figures, with the range beside them.
"""

from __future__ import annotations

import statistics
from itertools import combinations
from typing import Any

from benchmarks.vllm_report import _fmt, _range, _spread
from kvcache.bench.workload_report import _median, _ratio

TARGET = 1.3
"""Group TTFT p50 over a lone request's, with the connector's defaults (at most)."""
TARGET_MODE = "connector"

COUNTERS = (
    "kvcache_lookup_requests_total", "kvcache_lookup_l1_hit_tokens_total",
    "kvcache_lookup_l2_hit_tokens_total",
    "kvcache_retrieve_requests_total", "kvcache_retrieve_retrieved_tokens_total",
    "kvcache_retrieve_l2_tokens_total", "kvcache_l2_load_chunks_total", "kvcache_l2_load_seconds_total",
    "kvcache_retrieve_duration_seconds_sum", "kvcache_offload_load_seconds_total",
)  # fmt: skip
"""The daemon's counters read around each timed run (their differences are the run's)."""


def _short(name: str) -> str:
    return name.removeprefix("kvcache_").removesuffix("_total")


def _run(run: dict[str, Any]) -> dict[str, Any]:
    """One timed run's figures: TTFTs, what vLLM computed and loaded, the daemon's share."""
    ttft = [t * 1e3 for t in run["ttft_s"]]
    calls = run["calls"]
    return {
        "ttft_p50_ms": statistics.median(ttft), "ttft_max_ms": max(ttft),
        "cached_tokens": run["cached_tokens"],
        "computed_tokens": [p - c for p, c in zip(run["prompt_tokens"], run["cached_tokens"], strict=True)],
        "steps": len(run["step_s"]),
        "connector_ms": sum(s for _, s in calls.values()) * 1e3,
        "get_finished_ms": calls.get("get_finished", (0, 0.0))[1] * 1e3,
        "daemon": {_short(k): v for k, v in run["daemon"].items()},
    }  # fmt: skip


def _daemon(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each daemon counter's difference over the runs."""
    return {k: _median([r["daemon"][k] for r in runs]) for k in runs[0]["daemon"]}


def summarize(rounds: list[dict[str, Any]], requests: int, prefix: int, chunk: int,
              connectors: set[str]) -> dict[str, Any]:  # fmt: skip
    """Per mode: lone TTFT, group p50 and max, their per-round ratio (the target's for
    ``connector``), what was loaded and read from disk; ratios between modes; problems.
    ``connectors``: the modes that must have loaded the prefix from disk."""
    modes = list(rounds[0]["modes"]) if rounds else []
    per = {m: [{k: _run(rnd["modes"][m][k]) for k in ("lone", "group")} for rnd in rounds] for m in modes}
    out: dict[str, Any] = {"rounds": len(rounds), "requests": requests, "prefix": prefix,
                           "chunks": prefix // chunk, "modes": {}, "between": {}, "problems": []}  # fmt: skip
    for m, runs in per.items():
        ratio = _spread([_ratio(x["group"]["ttft_p50_ms"], x["lone"]["ttft_p50_ms"]) for x in runs])
        if m == TARGET_MODE:
            ratio["target"], ratio["met"] = TARGET, ratio["median"] <= TARGET
        out["modes"][m] = {
            "lone_ttft_ms": _spread([x["lone"]["ttft_p50_ms"] for x in runs]),
            "group_p50_ms": _spread([x["group"]["ttft_p50_ms"] for x in runs]),
            "group_max_ms": _spread([x["group"]["ttft_max_ms"] for x in runs]),
            "group_over_lone": ratio,
            "group_cached_tokens": sorted({c for x in runs for c in x["group"]["cached_tokens"]}),
            "group_computed_tokens": sorted({c for x in runs for c in x["group"]["computed_tokens"]}),
            "group_steps": _median([float(x["group"]["steps"]) for x in runs]),
            "group_connector_ms": _median([x["group"]["connector_ms"] for x in runs]),
            "group_get_finished_ms": _median([x["group"]["get_finished_ms"] for x in runs]),
            "daemon": {kind: _daemon([x[kind] for x in runs]) for kind in ("lone", "group")},
        }
    for a, b in combinations(modes, 2):
        out["between"][f"{a} / {b}"] = _spread([_ratio(x["group"]["ttft_p50_ms"], y["group"]["ttft_p50_ms"])
                                                for x, y in zip(per[a], per[b], strict=True)])  # fmt: skip
    _check(out, rounds, connectors)
    out["valid"] = not out["problems"]
    return out


def _check(out: dict[str, Any], rounds: list[dict[str, Any]], connectors: set[str]) -> None:
    """What would make the figures mean something else: modes disagreeing on a first token, a
    connector mode whose prefix was not (only) on disk or not loaded, an engine registering
    again in the middle of a round."""
    problems = out["problems"]
    for i, rnd in enumerate(rounds, 1):
        for kind in ("lone", "group"):
            firsts = {tuple(v[kind]["first_tokens"]) for v in rnd["modes"].values()}
            if len(firsts) > 1:
                problems.append(f"round {i}: the modes' first tokens differ ({kind})")
        if len(rnd["registrations"]) != len(set(rnd["registrations"])):
            problems.append(f"round {i}: an engine registered again during the timed runs")
        for m in connectors & set(rnd["modes"]):
            for kind, run in rnd["modes"][m].items():
                d = run["daemon"]
                if d["kvcache_lookup_l1_hit_tokens_total"] and kind == "lone":
                    problems.append(f"round {i}: {m} {kind}: the prefix was in L1")
                if not d["kvcache_l2_load_chunks_total"]:
                    problems.append(f"round {i}: {m} {kind}: nothing was read from disk")
                if min(run["cached_tokens"]) < out["prefix"]:
                    problems.append(f"round {i}: {m} {kind}: loaded {min(run['cached_tokens'])} of "
                                    f"{out['prefix']} prefix tokens")  # fmt: skip


def _per(d: dict[str, float], key: str) -> str:
    """Milliseconds of ``key`` per retrieve."""
    return f"{_ratio(d[key], d['retrieve_requests']) * 1e3:.1f}"


def table(s: dict[str, Any], labels: dict[str, str]) -> str:
    """The figures as plain text."""
    lines = [f"{s['requests']} requests sharing a {s['prefix']}-token prefix ({s['chunks']} chunks) on disk "
             f"only, arriving together; {s['rounds']} rounds (order rotating). "
             "TTFT ms, median [min .. max]:"]  # fmt: skip
    for m, x in s["modes"].items():
        r = x["group_over_lone"]
        verdict = f"  (target <= {r['target']}: {'met' if r['met'] else 'MISSED'})" if "target" in r else ""
        lines += [f"  {m}: {labels.get(m, m)}",
                  f"    lone {_range(x['lone_ttft_ms'], '.1f')}; "
                  f"group p50 {_range(x['group_p50_ms'], '.1f')}; "
                  f"group max {_range(x['group_max_ms'], '.1f')}",
                  f"    group p50 / lone: {_range(r, '.3f')}{verdict}; per round {_fmt(r['values'])}",
                  f"    tokens per request in the group: loaded/cached {x['group_cached_tokens']}, computed "
                  f"{x['group_computed_tokens']}; {x['group_steps']:.0f} steps to the last first token; "
                  f"connector {x['group_connector_ms']:.1f} ms "
                  f"(get_finished {x['group_get_finished_ms']:.1f})"]  # fmt: skip
        for kind in ("lone", "group"):
            d = x["daemon"][kind]
            if d.get("lookup_requests"):
                lines.append(f"    daemon, {kind}: disk reads {d['l2_load_chunks']:.0f} chunks in "
                             f"{d['l2_load_seconds'] * 1e3:.1f} ms; lookups {d['lookup_requests']:.0f} "
                             f"(L1 hit {d['lookup_l1_hit_tokens']:.0f}, "
                             f"L2 hit {d['lookup_l2_hit_tokens']:.0f} tokens); "
                             f"retrieves {d['retrieve_requests']:.0f}, "
                             f"{d['retrieve_retrieved_tokens']:.0f} tokens ({d['retrieve_l2_tokens']:.0f} "
                             f"from L2), {_per(d, 'retrieve_duration_seconds_sum')} ms each from start to "
                             f"end, {_per(d, 'offload_load_seconds')} ms each copying")  # fmt: skip
    for pair, r in s["between"].items():
        lines.append(f"  group p50, {pair}: {_range(r, '.3f')}; per round {_fmt(r['values'])}")
    lines += [f"  PROBLEM: {p}" for p in s["problems"]]
    return "\n".join(lines)


__all__ = ["COUNTERS", "TARGET", "summarize", "table"]
