"""``python -m kvcache.bench shared``: N requests sharing a prefix held only in L2 (disk), at once.

Each request is one engine instance (a TP-1 engine of its own) that looks up the prompt and
retrieves it into its own blocks, all N released together, with the prefix only on disk (a
fresh engine over the disk tier another engine filled, so L1 is empty). Reported per round:
the disk reads (the tier's own counters: target one read per chunk, however many requests),
the requests that got the whole prefix (target: all), and each request's time from its
lookup to its retrieve's end, p50 and max, beside one lone request's over the same disk.
Rounds are interleaved (lone, together, lone, ...) so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches

FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench shared", description=__doc__)
    p.add_argument("--requests", type=int, default=8, help="requests arriving together")
    p.add_argument("--tokens", type=int, default=4096, help="the shared prefix, in tokens")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", help="disk tier directory (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def _config(a: argparse.Namespace, path: str) -> EngineConfig:
    return EngineConfig(chunk_size=a.chunk_size, l1_size_bytes=512 << 20, l2_disk_path=path)


def _caches(a: argparse.Namespace, seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(FMT, a.layers, a.tokens // a.block_size, a.block_size, a.heads, a.head_size,
                        torch.bfloat16, seed=seed)  # fmt: skip
    assert isinstance(kv, list)
    return kv


def _round(a: argparse.Namespace, path: str, n: int, tokens: np.ndarray) -> dict[str, Any]:
    """One round: ``n`` requests at once on a fresh engine over the disk tier."""
    blocks = list(range(a.tokens // a.block_size))
    with CacheEngine(_config(a, path)) as e:
        for i in range(n):
            e.register(10 + i, "bench", _caches(a, seed=10 + i))
        start = threading.Barrier(n)
        took: list[float] = [0.0] * n
        got: list[int] = [0] * n

        def request(i: int) -> None:
            start.wait()
            t = time.perf_counter()
            e.lookup(10 + i, tokens, request_id=f"r{i}")
            got[i] = e.retrieve_async(10 + i, tokens, blocks).result(120).retrieved_tokens
            took[i] = time.perf_counter() - t

        threads = [threading.Thread(target=request, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        e.flush(60)
        (disk,) = e.status()["l2"]
        reads = int(disk["loads"] + disk["load_misses"])
    return {"reads": reads, "whole": sum(g == a.tokens for g in got), "took": took}


def main(argv: list[str]) -> int:
    a = _args(argv)
    path = a.dir or tempfile.mkdtemp(prefix="kvcache-bench-shared-")
    tokens = np.arange(1000, 1000 + a.tokens, dtype=np.uint32)
    chunks = a.tokens // a.chunk_size
    try:
        with CacheEngine(_config(a, path)) as w:
            w.register(1, "bench", _caches(a, seed=1))
            w.store(1, tokens, list(range(a.tokens // a.block_size)))
        lone: list[float] = []
        many: list[float] = []
        reads: list[int] = []
        whole: list[int] = []
        for _ in range(a.rounds):
            lone += _round(a, path, 1, tokens)["took"]
            r = _round(a, path, a.requests, tokens)
            many += r["took"]
            reads.append(r["reads"])
            whole.append(r["whole"])
    finally:
        if a.dir is None:
            shutil.rmtree(path, ignore_errors=True)
    lone_p50 = statistics.median(lone)
    rows = [
        {"what": f"{a.requests} requests at once, disk reads per round", "reads": reads,
         "chunks": chunks, "target": chunks},
        {"what": "requests that got the whole prefix, per round", "whole": whole, "of": a.requests},
        {"what": "lookup -> retrieved, one request alone", "p50_ms": lone_p50 * 1e3,
         "max_ms": max(lone) * 1e3},
        {"what": f"lookup -> retrieved, {a.requests} at once", "p50_ms": statistics.median(many) * 1e3,
         "max_ms": max(many) * 1e3, "p50_vs_alone": statistics.median(many) / lone_p50},
    ]  # fmt: skip
    for row in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": rows, "args": vars(a), "cpus": os.cpu_count()}, f, indent=2)
    ok = all(r == chunks for r in reads) and all(w == a.requests for w in whole)
    return 0 if ok else 1


__all__ = ["main"]
