"""``python -m kvcache.bench pipeline``: does a small call wait for a large one issued first?

One client, one daemon child process, a CPU cache in shared memory. A short prompt is stored
once. Each round then issues, back to back and without waiting, an asynchronous store of
``--store-tokens`` fresh tokens and an asynchronous retrieve of the short cached prompt
(``--retrieve-tokens``) into other blocks, and records when each future completes. Run for
every ``--windows`` value in the same process, rounds interleaved, so a one-call-at-a-time
client (window 1) and a pipelined one see the same machine.

Reported per window: the retrieve's and the store's latency from issue (p50, max), and in
how many rounds the retrieve finished before the store. Before the pipelined client the
retrieve completed only after the store, 420-570 ms later.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Any

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

GiB = 1 << 30
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model and fewer rounds")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--store-tokens", type=int, default=16384)
    p.add_argument("--retrieve-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--windows", default="1,32", help="comma-separated client windows to compare")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.rounds = 2, 3
    return a


def _tokens(seed: int, n: int) -> list[int]:
    return [seed * 1_000_003 + i for i in range(n)]


def _round(c: KVCacheClient, a: argparse.Namespace, seed: int, small: list[int]) -> dict[str, float]:
    """One store-then-retrieve; the seconds from issue to each completion."""
    bs = a.block_size
    big_blocks = list(range(a.store_tokens // bs))
    small_blocks = list(range(len(big_blocks), len(big_blocks) + a.retrieve_tokens // bs))
    done: dict[str, float] = {}
    both = threading.Event()

    def mark(name: str) -> Any:
        def cb(_f: Any) -> None:
            done[name] = time.perf_counter()
            if len(done) == 2:
                both.set()

        return cb

    t0 = time.perf_counter()
    store = c.store_async(_tokens(seed, a.store_tokens), big_blocks)
    store.add_done_callback(mark("store"))
    load = c.retrieve_async(small, small_blocks)
    load.add_done_callback(mark("retrieve"))
    both.wait(120)
    if store.result(0).stored_tokens != a.store_tokens or load.result(0) != a.retrieve_tokens:
        raise RuntimeError("the store or the retrieve did not move every token")
    return {"store_s": done["store"] - t0, "retrieve_s": done["retrieve"] - t0}


def main(argv: list[str]) -> int:
    a = _args(argv)
    windows = [int(w) for w in a.windows.split(",")]
    token_bytes = 2 * a.layers * a.heads * a.head_size * 2
    num_blocks = (a.store_tokens + a.retrieve_tokens) // a.block_size
    l1_gb = (len(windows) * (a.rounds + 1) + 1) * a.store_tokens * token_bytes / GiB * 1.1
    flags = ["--chunk-size", str(a.chunk_size), "--l1-size-gb", f"{l1_gb:.3f}", "--disable-observability"]
    rows: list[dict[str, Any]] = []
    with DaemonProcess(flags) as daemon:
        clients = {}
        for i, w in enumerate(windows):
            kv = to_shared(make_kv_caches(FMT, a.layers, num_blocks, a.block_size, a.heads, a.head_size,
                                          torch.bfloat16, seed=i))  # fmt: skip
            c = KVCacheClient(daemon.endpoint, 10 + i, "bench", timeout_s=60, window=w)
            c.register_kv_caches(kv)
            clients[w] = c
        small = _tokens(7, a.retrieve_tokens)
        for c in clients.values():
            c.store(small, list(range(a.retrieve_tokens // a.block_size)))
        times: dict[int, list[dict[str, float]]] = {w: [] for w in windows}
        for r in range(a.rounds + 1):  # round 0 warms up (L1 extents, page faults)
            for w, c in clients.items():
                t = _round(c, a, 100 * r + w, small)
                if r:
                    times[w].append(t)
        for w in windows:
            ts = times[w]
            rows.append({
                "what": f"window {w}: {a.store_tokens}-token store, then {a.retrieve_tokens}-token retrieve",
                "retrieve_p50_ms": statistics.median(t["retrieve_s"] for t in ts) * 1e3,
                "retrieve_max_ms": max(t["retrieve_s"] for t in ts) * 1e3,
                "store_p50_ms": statistics.median(t["store_s"] for t in ts) * 1e3,
                "retrieve_first": f"{sum(t['retrieve_s'] < t['store_s'] for t in ts)}/{len(ts)}",
            })  # fmt: skip
        for c in clients.values():
            c.close()
        rc = daemon.stop()
    for row in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": rows, "args": vars(a), "cpus": os.cpu_count()}, f, indent=2)
    return 0 if rc == 0 else 1


__all__ = ["main"]
