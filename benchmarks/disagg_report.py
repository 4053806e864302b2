"""The disaggregation benchmark's figures: percentiles pooled over the rounds, split / single
ratios, the decode side's recompute, and the table printed.

Separate from ``disagg`` (which starts processes and runs rounds) so the arithmetic is
checked on made-up records, the way ``vllm_report`` is for the vLLM benchmark.
"""

from __future__ import annotations

from typing import Any

from benchmarks.disagg_client import Stream
from kvcache.bench.workload_report import _pct

TARGETS = ("split", "single")


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per target: percentiles pooled over the rounds, the decode side's recompute per request;
    then split / single ratios, output agreement, and what went wrong."""
    out: dict[str, Any] = {"targets": {}, "ratios": {}, "problems": []}
    for target in TARGETS:
        rounds = [rnd[target] for rnd in raw["rounds"]]
        streams = [Stream(**s) for rnd in rounds for s in rnd["streams"]]
        ttft = [s.ttft_s * 1e3 for s in streams if s.kind == "long" and s.ttft_s is not None]
        itl = [g * 1e3 for s in streams if s.kind == "decode" for g in s.gaps_s()]
        prefill = [s.prefill_s * 1e3 for s in streams if s.kind == "long" and s.prefill_s is not None]
        n = len(streams)
        out["targets"][target] = {
            "ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "n": len(ttft)},
            "itl_ms": {"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99), "n": len(itl)},
            "prefill_call_ms": {"p50": _pct(prefill, 0.5), "p99": _pct(prefill, 0.99), "n": len(prefill)},
            "requests": n,
            "errors": [s.error for s in streams if s.error],
            "computed_prompt_tokens_per_request": sum(r["local_compute_tokens"] for r in rounds) / max(n, 1),
            "loaded_tokens_per_request": sum(r["loaded_tokens"] for r in rounds) / max(n, 1),
            "prompt_tokens_per_request": sum(r.get("prompt_tokens", 0) for r in rounds) / max(n, 1),
        }
        for e in out["targets"][target]["errors"]:
            out["problems"].append(f"{target}: {e}")
        if not ttft or len(ttft) < sum(1 for s in streams if s.kind == "long"):
            out["problems"].append(f"{target}: a long prompt produced no token")
    split, single = out["targets"]["split"], out["targets"]["single"]
    for fig in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            base = single[fig][q]
            out["ratios"][f"{fig} {q}"] = split[fig][q] / base if base else None
    same = total_n = 0
    for rnd in raw["rounds"]:
        pairs = zip(rnd["split"]["streams"], rnd["single"]["streams"], strict=True)
        for a, b in pairs:
            total_n += 1
            same += a["text"] == b["text"] and not a["error"]
    out["outputs_agree"] = [same, total_n]
    return out


def table(raw: dict[str, Any], fig: dict[str, Any]) -> str:
    split, single = fig["targets"]["split"], fig["targets"]["single"]
    lines = [f"{'':28}{'split (proxy)':>14}{'single':>12}{'split/single':>14}"]
    for name in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            ratio = fig["ratios"][f"{name} {q}"]
            label = ("long-prompt TTFT" if name == "ttft_ms" else "decoders' inter-token") + f" {q} ms"
            lines.append(
                f"{label:<28}{split[name][q]:>14.1f}{single[name][q]:>12.1f}"
                + (f"{ratio:>14.2f}" if ratio is not None else f"{'-':>14}")
            )
        pre = split["prefill_call_ms"]
        if name == "ttft_ms" and pre["n"]:
            lines.append(
                f"{'  the prefill call, p50':<28}{pre['p50']:>14.1f}{'-':>12}   (p99 {pre['p99']:.1f})"
            )
    lines.append(
        f"{'prompt tokens computed/req':<28}{split['computed_prompt_tokens_per_request']:>14.1f}"
        f"{single['computed_prompt_tokens_per_request']:>12.1f}   (split: on the decode server)"
    )
    lines.append(f"{'tokens loaded/req':<28}{split['loaded_tokens_per_request']:>14.1f}{'-':>12}")
    lines.append(
        f"{'prompt tokens/req':<28}{split['prompt_tokens_per_request']:>14.1f}"
        f"{single['prompt_tokens_per_request']:>12.1f}   (the decoders' short prompts included)"
    )
    same, n = fig["outputs_agree"]
    lines.append(f"outputs equal between the two targets: {same}/{n} requests (greedy)")
    lines += [f"PROBLEM: {p}" for p in fig["problems"]]
    return "\n".join(lines)
