"""``python -m kvcache.bench daemon``: what the daemon costs over the in-process engine.

Three measurements against a real ``python -m kvcache.server`` child process on loopback:

* **lookup round trip** (p50/p99) of a prompt whose chunks are all cached, over the Unix
  socket (``ipc://``, the local default) and over loopback TCP side by side, interleaved in
  rounds so both see the same machine load, next to the in-process ``CacheEngine.lookup`` of
  the same prompt and a bare ping per transport (the floor); targets: p50 <= 150 us, and
  ``ipc://`` lookup p50 <= 0.7 x the TCP one; and a **batched step lookup** (one
  ``LookupBatch`` of ``--batch`` prompts, each sharing all but its last chunk with the others,
  as requests sharing a system prompt do, built as the vLLM connector builds a step's batch:
  the shared head sent once, ``codec.with_heads``) over ``ipc://`` in the same rounds;
  target: p50 <= 2 x one single lookup's;
* **store/retrieve throughput** through the daemon (CPU cache in shared memory) against the
  in-process engine doing the same work; target >= 0.6 x in-process;
* **8 concurrent clients** (separate processes, separate instances) storing, looking up and
  retrieving with byte-exact checks; target: no errors.

Both sides run with events off by default (``--observability`` turns the daemon's bus on), so
the ratio measures the transport, not the subscribers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids, with_heads
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

GiB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvcache.bench daemon",
        description="Lookup round trip, store/retrieve throughput and concurrent clients through the "
        "daemon, against the in-process engine.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: well under a minute on 2 cores")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--chunks", type=int, default=32, help="chunks per store/retrieve round")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=5, help="store/retrieve rounds (fresh tokens each)")
    p.add_argument("--lookups", type=int, default=3000, help="timed lookups (after 300 warm-up)")
    p.add_argument("--lookup-tokens", type=int, default=1024, help="prompt length of a lookup")
    p.add_argument("--batch", type=int, default=32, help="requests in one batched step lookup")
    p.add_argument("--clients", type=int, default=8, help="concurrent client processes")
    p.add_argument("--client-rounds", type=int, default=20, help="store/lookup/retrieve per client")
    p.add_argument("--observability", action="store_true", help="keep the daemon's event bus on")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.heads, a.chunks, a.reps, a.lookups, a.client_rounds = 4, 4, 16, 3, 1500, 8
    return a


def _caches(a: argparse.Namespace, num_blocks: int, seed: int) -> Any:
    kv = make_kv_caches(FMT, a.layers, num_blocks, a.block_size, a.heads, a.head_size,
                        DTYPES[a.dtype], seed=seed)  # fmt: skip
    return to_shared(kv)


def _tokens(rep: int, n: int) -> list[int]:
    return [rep * 1_000_003 + i for i in range(n)]


def _step_prompts(a: argparse.Namespace, shared: list[int]) -> list[list[int]]:
    """``--batch`` prompts of ``--lookup-tokens`` each: ``shared`` but for the last chunk
    (token ids of a real vocabulary: under 2**32)."""
    head = shared[: len(shared) - a.chunk_size]
    cs = a.chunk_size
    return [head + list(range(50_000 + i * cs, 50_000 + (i + 1) * cs)) for i in range(a.batch)]


def _l1_chunks(a: argparse.Namespace) -> int:
    """L1 for a throughput rep, its warm-up and slack, and the batched lookup's prompts."""
    return 3 * a.chunks + a.batch + a.lookup_tokens // a.chunk_size


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _timed(fn: Callable[[], object], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _throughput(a: argparse.Namespace, store: Callable[..., Any], retrieve: Callable[..., int],
                kv: Any, token_bytes: int) -> tuple[float, float]:  # fmt: skip
    """Best-of-reps GB/s of storing then retrieving ``chunks`` chunks of fresh tokens, after
    enough untimed reps to have written every L1 slot once: a slot's first write faults its
    pages in, which a long-running daemon pays once, not per store (with fewer warm-up reps
    the figure depends on how much larger L1 is than one rep)."""
    n = a.chunks * a.chunk_size
    blocks = list(range(n // a.block_size))
    best_store = best_retrieve = 0.0
    warm = -(-_l1_chunks(a) // a.chunks)
    for rep in range(warm + a.reps):
        toks = _tokens(rep + 1, n)
        t = time.perf_counter()
        stored = store(toks, blocks).stored_tokens
        store_s = time.perf_counter() - t
        t = time.perf_counter()
        got = retrieve(toks, blocks)
        retrieve_s = time.perf_counter() - t
        if stored != n or got != n:
            raise RuntimeError(f"rep {rep}: stored {stored}, retrieved {got} of {n} tokens")
        if rep >= warm:
            best_store = max(best_store, n * token_bytes / store_s / 1e9)
            best_retrieve = max(best_retrieve, n * token_bytes / retrieve_s / 1e9)
    return best_store, best_retrieve


def _client_proc(endpoint: str, instance: int, a: argparse.Namespace, out: Any) -> None:
    """One of the concurrent clients: its own instance, cache and tokens; byte-exact checks.

    A retrieve may return less than the lookup promised when other clients' stores evicted a
    chunk in between (nothing is pinned across calls); that is counted, not an error. Any byte
    of the returned prefix that differs is an error.
    """
    errors, lookups, short = [], [], 0
    try:
        kv: list[torch.Tensor] = _caches(a, 4 * a.chunk_size // a.block_size, seed=instance)
        original: list[torch.Tensor] = clone_caches(kv)  # type: ignore[assignment]
        blocks = list(range(4 * a.chunk_size // a.block_size))
        with KVCacheClient(endpoint, instance, f"model-{instance % 2}", timeout_s=60) as c:
            c.register_kv_caches(kv)
            for r in range(a.client_rounds):
                toks = _tokens(1000 * instance + r, 4 * a.chunk_size)
                c.store(toks, blocks)
                t = time.perf_counter()
                hit = c.lookup(toks)
                lookups.append(time.perf_counter() - t)
                for t_ in kv:
                    t_.zero_()
                got = c.retrieve(toks, blocks)
                n = got // a.block_size
                if not caches_equal([x[:, :n] for x in kv], [x[:, :n] for x in original]):
                    errors.append(f"round {r}: the {got} tokens retrieved are not byte-exact")
                short += got < hit
                for x, y in zip(kv, original, strict=True):
                    x.copy_(y)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    out.put({"instance": instance, "errors": errors, "lookups": lookups, "short": short})


def main(argv: list[str]) -> int:
    a = _args(argv)
    n_blocks = a.chunks * a.chunk_size // a.block_size
    kv = _caches(a, max(n_blocks, a.lookup_tokens // a.block_size), seed=0)
    token_bytes = 2 * a.layers * a.heads * a.head_size * torch.empty((), dtype=DTYPES[a.dtype]).element_size()
    l1_gb = _l1_chunks(a) * a.chunk_size * token_bytes / GiB
    flags = ["--chunk-size", str(a.chunk_size), "--l1-size-gb", f"{l1_gb:.4f}"]
    if not a.observability:
        flags.append("--disable-observability")
    rows: list[dict[str, Any]] = []
    lookup_toks = _tokens(0, a.lookup_tokens)
    lookup_blocks = list(range(a.lookup_tokens // a.block_size))

    engine = CacheEngine(EngineConfig(chunk_size=a.chunk_size, l1_size_bytes=int(l1_gb * GiB)))
    try:
        engine.register(0, "bench", kv)
        engine.store(0, lookup_toks, lookup_blocks)
        local = _timed(lambda: engine.lookup(0, lookup_toks), a.lookups, 300)
        local_tp = _throughput(a, lambda t, b: engine.store(0, t, b),
                               lambda t, b: engine.retrieve(0, t, b), kv, token_bytes)  # fmt: skip
    finally:
        engine.close()

    with DaemonProcess(flags, tcp=True) as daemon:  # TCP too, to compare the transports
        with KVCacheClient(daemon.ipc_endpoint, 0, "bench", timeout_s=60) as c, \
                KVCacheClient(daemon.endpoint, 1, "bench", timeout_s=60) as tcp:  # fmt: skip
            c.register_kv_caches(kv)
            tcp.register_kv_caches(kv)
            c.store(lookup_toks, lookup_blocks)
            step = _step_prompts(a, lookup_toks)
            for toks in step:
                c.store(toks, lookup_blocks)
            whole = [m.LookupItem(token_ids=pack_ids(t), request_id=f"r{i}") for i, t in enumerate(step)]
            items = with_heads(whole, a.chunk_size)  # as the vLLM connector sends a step's lookups
            if [h.hit_tokens for h in c.lookup_batch(items)] != [a.lookup_tokens] * a.batch:
                raise RuntimeError("the batched step lookup's prompts are not all cached")
            timings: dict[str, list[float]] = {k: [] for k in ("pi", "pt", "li", "lt", "lb")}
            calls: dict[str, Callable[[], object]] = {
                "pi": c.ping, "pt": tcp.ping,
                "li": lambda: c.lookup(lookup_toks), "lt": lambda: tcp.lookup(lookup_toks),
                "lb": lambda: c.lookup_batch(items),
            }  # fmt: skip
            rounds = 10
            for _ in range(rounds):  # interleaved: both transports share every load change
                for key, fn in calls.items():
                    timings[key] += _timed(fn, a.lookups // rounds, 30)
            remote_tp = _throughput(a, c.store, c.retrieve, kv, token_bytes)

        for name, xs in (("ping ipc:// (floor)", timings["pi"]), ("ping tcp:// (floor)", timings["pt"]),
                         ("lookup via daemon, ipc://", timings["li"]),
                         ("lookup via daemon, tcp://", timings["lt"]),
                         (f"batched step lookup of {a.batch} via daemon, ipc://", timings["lb"]),
                         ("lookup in-process", local)):  # fmt: skip
            rows.append({"what": name, "tokens": a.lookup_tokens,
                         "p50_us": _percentile(xs, 0.5) * 1e6, "p99_us": _percentile(xs, 0.99) * 1e6,
                         "mean_us": statistics.fmean(xs) * 1e6})  # fmt: skip
        ipc_p50, tcp_p50 = _percentile(timings["li"], 0.5), _percentile(timings["lt"], 0.5)
        rows.append({"what": "lookup p50 ipc/tcp", "ratio": ipc_p50 / tcp_p50, "target": 0.7})
        batch_p50 = _percentile(timings["lb"], 0.5)
        rows.append({"what": f"batched lookup of {a.batch} / one lookup, p50 ipc://",
                     "ratio": batch_p50 / ipc_p50, "target": 2.0,
                     "vs_one_at_a_time": batch_p50 / (a.batch * ipc_p50)})  # fmt: skip
        for i, op in enumerate(("store", "retrieve")):
            rows.append({"what": f"{op} GB/s", "daemon": remote_tp[i], "in_process": local_tp[i],
                         "ratio": remote_tp[i] / local_tp[i] if local_tp[i] else 0.0})  # fmt: skip

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_client_proc, args=(daemon.endpoint, 100 + i, a, out))
                 for i in range(a.clients)]  # fmt: skip
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        wall = time.perf_counter() - t0
        errors = [e for r in results for e in r["errors"]]
        lat = [x for r in results for x in r["lookups"]]
        rows.append({"what": f"{a.clients} concurrent clients", "rounds": a.clients * a.client_rounds,
                     "errors": len(errors), "evicted_before_retrieve": sum(r["short"] for r in results),
                     "lookup_p50_us": _percentile(lat, 0.5) * 1e6 if lat else 0.0,
                     "lookup_p99_us": _percentile(lat, 0.99) * 1e6 if lat else 0.0,
                     "wall_s": wall})  # fmt: skip
        for e in errors[:5]:
            print(f"client error: {e}", file=sys.stderr)
        daemon_rc = daemon.stop()

    _emit(rows, a)
    ok = not errors and daemon_rc == 0
    return 0 if ok else 1


def _emit(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    for row in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": rows, "args": vars(a), "torch": torch.__version__,
                       "cpus": os.cpu_count()}, f, indent=2)  # fmt: skip


__all__ = ["main"]
