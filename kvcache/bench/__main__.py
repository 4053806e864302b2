"""Entry point: ``python -m kvcache.bench NAME [options]``, NAME one of the table below.

Each benchmark lives in its own module and is imported only when asked for, so the
transfer benchmark runs on a GPU machine that has torch but none of the daemon's
dependencies. The serving engines' harnesses (vLLM, SGLang, disaggregation) need a checkout
(their venv scripts, their drivers): they live in the checkout's ``benchmarks/`` package,
``python -m benchmarks.vllm`` and so on.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# name -> (module, function, one-line help)
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "transfer": ("kvcache.bench.transfer", "main", "block-id copies vs memcpy / cudaMemcpy ceilings"),
    "events": ("kvcache.bench.events", "main", "event bus publish latency and dispatch rate"),
    "l1": ("kvcache.bench.storage", "main_l1", "engine store/retrieve through L1 vs raw transfer"),
    "l2": ("kvcache.bench.storage", "main_l2", "disk and Redis L2 throughput; --redis-cluster: vs a cluster"),
    "daemon": ("kvcache.bench.daemon", "main", "lookup RTT and throughput through the daemon"),
    "shared": ("kvcache.bench.shared_prefix", "main", "N requests sharing a prefix on disk, at once"),
    "pipeline": ("kvcache.bench.pipeline", "main", "small retrieve after a large store: window 1 vs N"),
    "workload": ("kvcache.bench.workload", "main", "multi-turn chat workload through the daemon"),
    "noisy": ("kvcache.bench.noisy", "main", "a tenant's latency while another floods: ratio to no flood"),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        print("usage: python -m kvcache.bench {" + ",".join(BENCHMARKS) + "} [options]\n")
        for name, (_, _, text) in BENCHMARKS.items():
            print(f"  {name:<11} {text}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    module, func, _ = BENCHMARKS[args[0]]
    entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return entry(args[1:])


if __name__ == "__main__":
    sys.exit(main())
