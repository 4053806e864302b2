"""``python -m benchmarks.disagg``: prefill/decode disaggregation through kvcache against
one vLLM instance doing both, on the same workload, in one run (issue 23).

The split: a prefill vLLM server and a decode vLLM server, both with kvcache's connector and
one daemon, behind the proxy (``kvcache.integrations.vllm.proxy``). The single instance: one
plain vLLM server (no connector; ``--single connector`` gives it kvcache's connector in its
own key scope, to tell the split's cost from the connector's). The workload
(``disagg_client.Workload``): a few requests decode long outputs while long prompts arrive
one after another; every request streams, so
the client sees each token arrive. Figures, pooled over the rounds, for each target:

* time to first token of the long prompts, p50 and p99;
* inter-token latency of the decoding requests (the gaps between their tokens), p50 and p99:
  what a long prefill costs the requests already decoding, the split's reason to exist;
* on the decode server, prompt tokens it computed itself per request (vLLM's
  ``vllm:prompt_tokens_by_source_total{source="local_compute"}``) and tokens loaded from
  kvcache per request: what the split still recomputes.

Every round sends fresh prompts, the same ones to both targets, the targets' order rotating
from round to round; both targets' outputs are compared (greedy). ``--roles split`` (the
default) runs the two split servers as ``kv_producer`` / ``kv_consumer``; ``--roles both``
runs both in ``kv_both`` (the decode side then races the prefill side's asynchronous stores).

What this measures on a 2-core machine: all four processes share two cores, so the split's
servers take CPU from each other and a prefill never runs truly beside a decode; the figures
show the protocol's cost and the decode side's recompute, not the split's gain on separate
hardware (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.disagg_client import Stream, Workload
from benchmarks.disagg_client import run as run_workload
from benchmarks.disagg_report import TARGETS, summarize, table
from benchmarks.disagg_servers import VllmServer, connector_config, total
from benchmarks.engine_args import add_engine_args, add_model_args, model_spec, work_dir
from benchmarks.vllm_engines import find_vllm_python, with_checkout
from kvcache.bench.args import parse_quick
from kvcache.integrations.vllm.proxy.launch import ProxyProcess
from kvcache.server.launch import DaemonProcess

ROLES = {"both": ("kv_both", "kv_both"), "split": ("kv_producer", "kv_consumer")}
LOADED = "vllm:kvcache_loaded_tokens_total"


def computed(samples: dict[str, float]) -> float:
    """Prompt tokens a server computed itself (neither its prefix cache nor kvcache had them)."""
    return total(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.disagg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run: toy model, one small round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds on each target first")
    p.add_argument(
        "--roles",
        choices=tuple(ROLES),
        default="split",
        help="the split servers' kv_role: both = kv_both, split = kv_producer / kv_consumer",
    )
    p.add_argument(
        "--single",
        choices=("plain", "connector"),
        default="plain",
        help="the single instance: vLLM alone, or with kvcache's connector (kv_both) on the same "
        "daemon, which isolates the split from the connector's own per-step cost",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--decoders", type=int, default=4, help="requests decoding while the long prompts arrive")
    g.add_argument("--decode-prompt", type=int, default=64)
    g.add_argument("--decode-tokens", type=int, default=256)
    g.add_argument("--long-prompts", type=int, default=4)
    g.add_argument("--long-prompt", type=int, default=2048, help="tokens of each long prompt (+13 each)")
    g.add_argument("--long-tokens", type=int, default=16, help="tokens each long prompt generates")
    g.add_argument("--gap", type=float, default=0.5, help="seconds between two long prompts' arrivals")
    add_model_args(p)
    g = add_engine_args(p, "engines (servers), daemon", 256, "vLLM's KV cache per server")
    g.add_argument("--l1-gb", type=float, default=1.0)
    g.add_argument(
        "--bind",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin the prefill server to the first half of this process's cores, the decode "
        "server to the second, the single server to all (VLLM_CPU_OMP_THREADS_BIND); "
        "vLLM's default binds every server to every core, and their OpenMP threads "
        "then fight for them",
    )
    p.add_argument("--out", metavar="PATH", help="also write raw streams and figures as JSON")
    return p


QUICK = {
    "rounds": 1,
    "layers": 2,
    "hidden": 128,
    "heads": 4,
    "kv_heads": 2,
    "decoders": 2,
    "decode_tokens": 48,
    "long_prompts": 2,
    "long_prompt": 512,
    "long_tokens": 4,
    "gap": 0.2,
    "kv_cache_mb": 64,
    "l1_gb": 0.25,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    a = parse_quick(parser, argv, QUICK)
    if a.rounds < 1 or a.decoders < 0 or a.long_prompts < 1:
        parser.error("--rounds and --long-prompts must be >= 1, --decoders >= 0")
    return a


def workload(a: argparse.Namespace, seed: int, vocab: int) -> Workload:
    return Workload.make(
        seed,
        decoders=a.decoders,
        decode_prompt=a.decode_prompt,
        decode_tokens=a.decode_tokens,
        long_prompts=a.long_prompts,
        long_prompt=a.long_prompt,
        long_tokens=a.long_tokens,
        gap_s=a.gap,
        vocab=vocab,
    )


def core_lists() -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND per server for ``--bind``: the split gets the same cores as
    the single instance, half each; empty where there is one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    half = len(cores) // 2

    def ids(c: list[int]) -> str:
        return ",".join(map(str, c))

    return {"prefill": ids(cores[:half]), "decode": ids(cores[half:]), "single": ids(cores)}


def seeds(a: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The warm-up rounds' seeds and the timed rounds': all distinct, so that no target ever
    sees a prompt twice (its prefix cache would answer). Non-negative: ``random.Random(-n)``
    draws what ``Random(n)`` does."""
    return [1_000_000 + r for r in range(a.warmup)], list(range(a.rounds))


def run(a: argparse.Namespace, python: str, work: Path) -> dict[str, Any]:
    """Start the daemon, the three servers and the proxy; run the rounds; the raw records."""
    model = model_spec(a)
    model_dir = work / f"model-{a.layers}x{a.hidden}-{a.heads}h{a.kv_heads}kv"
    env = with_checkout(dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(a.torch_threads)))
    subprocess.run(
        [
            python,
            "-m",
            "benchmarks.vllm_driver",
            "make-model",
            "--dir",
            str(model_dir),
            "--spec",
            msgspec.json.encode(model).decode(),
        ],
        check=True,
        env=env,
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
    )
    max_len = max(4096, a.long_prompt + 13 * a.long_prompts + a.long_tokens + 64)
    kw = {"block_size": a.block_size, "max_model_len": max_len, "kv_cache_mb": a.kv_cache_mb}
    prefill_role, decode_role = ROLES[a.roles]
    raw: dict[str, Any] = {
        "model": model.label(),
        "roles": [prefill_role, decode_role],
        "single": a.single,
        "rounds": [],
    }
    flags = ["--chunk-size", str(a.chunk_size), "--l1-size-gb", str(a.l1_gb)]
    with DaemonProcess(flags) as daemon:
        env["KVCACHE_RUNTIME_DIR"] = daemon.runtime_dir
        extra = {"timeout_s": 30.0}
        # Its own key scope: it must not load what the split stored for the same prompts.
        own_scope = {**extra, "model_name": "bench-single"}
        single = connector_config("kv_both", own_scope) if a.single == "connector" else None
        binds = core_lists() if a.bind else {}
        envs = {
            n: {**env, "VLLM_CPU_OMP_THREADS_BIND": binds[n]} if n in binds else env
            for n in ("prefill", "decode", "single")
        }
        raw["bind"] = binds
        servers = [
            VllmServer(
                "prefill",
                python,
                model_dir,
                envs["prefill"],
                work,
                connector_config(prefill_role, extra),
                **kw,
            ),
            VllmServer(
                "decode", python, model_dir, envs["decode"], work, connector_config(decode_role, extra), **kw
            ),
            VllmServer("single", python, model_dir, envs["single"], work, single, **kw),
        ]
        proxy = None
        try:
            t0 = time.monotonic()
            for s in servers:
                s.wait_ready(a.timeout)
            raw["servers_ready_s"] = time.monotonic() - t0
            proxy = ProxyProcess(
                python,
                [servers[0].url],
                [servers[1].url],
                ["--read-timeout", str(a.timeout), "--prefill-timeout", str(a.timeout)],
            )
            url = {"split": proxy.url, "single": servers[2].url}
            counted = {"split": servers[1], "single": servers[2]}
            warm, timed = seeds(a)
            for seed in warm:
                for target in TARGETS:
                    run_workload(url[target], workload(a, seed, model.vocab), a.timeout)
            for r, seed in enumerate(timed):
                w = workload(a, seed, model.vocab)
                got: dict[str, Any] = {}
                for target in TARGETS[r % 2 :] + TARGETS[: r % 2]:
                    before = counted[target].metrics()
                    streams = run_workload(url[target], w, a.timeout)
                    after = counted[target].metrics()
                    got[target] = {
                        "streams": [dataclasses.asdict(s) for s in streams],
                        "local_compute_tokens": computed(after) - computed(before),
                        "loaded_tokens": total(after, LOADED) - total(before, LOADED),
                        "prompt_tokens": sum(len(p) for p in w.decoders + w.long_prompts),
                    }
                    print(
                        f"round {r + 1}/{a.rounds} {target}: {_brief(streams)}", file=sys.stderr, flush=True
                    )
                raw["rounds"].append(got)
        finally:
            if proxy is not None:
                proxy.stop()
            for s in servers:
                s.stop()
    return raw


def _brief(streams: list[Stream]) -> str:
    ttft = [s.ttft_s for s in streams if s.kind == "long" and s.ttft_s is not None]
    errors = sum(1 for s in streams if s.error)
    return f"long-prompt TTFT {', '.join(f'{t * 1e3:.0f}' for t in ttft)} ms; {errors} errors"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    python = a.vllm_python or find_vllm_python()
    load0, t0 = os.getloadavg(), time.monotonic()
    with work_dir(a, "kvcache-bench-disagg-") as work:
        raw = run(a, python, work)
    fig = summarize(raw)
    load1 = os.getloadavg()
    machine = {
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": load1,
        "wall_s": time.monotonic() - t0,
    }
    print(
        f"model: {raw['model']}; split roles {raw['roles'][0]} / {raw['roles'][1]}; single instance: "
        f"{a.single}; servers ready in {raw['servers_ready_s']:.0f} s"
    )
    print(
        f"workload x {a.rounds} rounds: {a.decoders} requests decoding {a.decode_tokens} tokens while "
        f"{a.long_prompts} prompts of ~{a.long_prompt} tokens arrive {a.gap:g} s apart "
        f"({a.long_tokens} tokens each)"
    )
    print(
        f"machine: {machine['cpus']} CPUs, load average {load0[0]:.2f} at start, "
        f"{load1[0]:.2f} at end; {machine['wall_s']:.0f} s"
    )
    print(table(raw, fig))
    if a.out:
        Path(a.out).write_text(
            json.dumps({"args": vars(a), "machine": machine, "figures": fig, "raw": raw}, indent=1)
        )
    return 0


__all__ = ["build_parser", "main", "parse_args", "summarize", "table"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
