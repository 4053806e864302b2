"""``python -m kvcache.demo``: the daemon doing its job, end to end, in well under a minute.

Starts ``python -m kvcache.server`` on its embedded defaults (free ports, no external service)
and plays a small serving engine against it: a vLLM-layout KV cache in shared memory,
requests that share a system prompt, then store, lookup and retrieve through
``KVCacheClient``. Prints hits, throughput, a byte-exact check and the metrics URL. It lives
in the package (not in examples/) because it is the README's first command.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import DaemonStartError
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 8, 1024, 16, 4, 64
SYSTEM_TOKENS, USER_TOKENS, REQUESTS = 1024, 1024, 8
SHOWN_METRICS = (
    "kvcache_store_stored_tokens_total",
    "kvcache_lookup_hit_tokens_total",
    "kvcache_retrieve_retrieved_tokens_total",
)


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvcache.demo",
        description="Start the kvcache daemon on its defaults and a small demo engine that stores, "
        "looks up and retrieves KV blocks through it; prints hits, throughput and the metrics URL.",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the daemon up after the demo (Ctrl-C stops it) to browse its metrics",
    )
    p.add_argument("--verbose", action="store_true", help="echo the daemon's log")  # fmt: skip
    return p.parse_args(argv)


def _prompts(offset: int) -> list[list[int]]:
    """REQUESTS prompts: one shared system prompt, then a distinct user turn each."""
    system = [(7 * i) % 32000 for i in range(SYSTEM_TOKENS)]
    return [
        system + [(offset + r * USER_TOKENS + i) % 32000 + 1 for i in range(USER_TOKENS)]
        for r in range(REQUESTS)
    ]


def _blocks(r: int) -> list[int]:
    per = (SYSTEM_TOKENS + USER_TOKENS) // BLOCK_SIZE
    return list(range(r * per, (r + 1) * per))


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name in SHOWN_METRICS:
        values = re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, flags=re.M)
        out[name] = sum(float(v) for v in values)
    return out


def run(daemon: DaemonProcess) -> bool:
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    kv = to_shared(make_kv_caches(fmt, LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float16))
    # Same tokens, same KV: every request's system-prompt blocks hold request 0's values.
    shared = _blocks(0)[: SYSTEM_TOKENS // BLOCK_SIZE]
    for r in range(1, REQUESTS):
        for layer in kv:
            layer[:, _blocks(r)[: len(shared)]] = layer[:, shared]
    original = clone_caches(kv)
    token_bytes = 2 * LAYERS * HEADS * HEAD_SIZE * 2
    print(f"engine:   vLLM FlashAttention layout, {LAYERS} layers x {BLOCKS} blocks of {BLOCK_SIZE} "
          f"tokens, fp16, {BLOCKS * BLOCK_SIZE * token_bytes / 2**20:.0f} MiB in a sealed memfd")  # fmt: skip
    prompts = _prompts(offset=0)
    client = KVCacheClient(daemon.endpoint, instance_id=0, model_name="demo-model", timeout_s=30)
    try:
        reg = client.register_kv_caches(kv)
        n_tokens = REQUESTS * len(prompts[0])

        t0 = time.perf_counter()
        results = [client.store(p, _blocks(r)) for r, p in enumerate(prompts)]
        store_s = time.perf_counter() - t0
        new = sum(r.stored_chunks for r in results)
        skipped = sum(r.skipped_chunks for r in results)
        stored_bytes = sum(r.stored_tokens for r in results) * token_bytes
        print(f"store:    {REQUESTS} requests, {n_tokens} tokens -> {new} new chunks of "
              f"{reg.chunk_size} tokens, {skipped} skipped (the shared system prompt), "
              f"{stored_bytes / store_s / 1e9:.2f} GB/s")  # fmt: skip

        # New conversations with the same system prompt: only that prefix is cached.
        fresh = _prompts(offset=10_000)
        rtts, hits = [], 0
        for p in fresh + prompts:
            t = time.perf_counter()
            hits += client.lookup(p)
            rtts.append(time.perf_counter() - t)
        asked = 2 * n_tokens
        print(f"lookup:   {2 * REQUESTS} prompts ({REQUESTS} seen, {REQUESTS} new sharing the "
              f"system prompt): {hits}/{asked} tokens hit ({100 * hits / asked:.0f}%), "
              f"median round trip {statistics.median(rtts) * 1e6:.0f} us")  # fmt: skip

        for t in kv:
            t.zero_()
        t0 = time.perf_counter()
        got = sum(client.retrieve(p, _blocks(r)) for r, p in enumerate(prompts))
        retrieve_s = time.perf_counter() - t0
        exact = caches_equal(kv, original)
        print(f"retrieve: {got}/{n_tokens} tokens back into zeroed blocks, "
              f"{got * token_bytes / retrieve_s / 1e9:.2f} GB/s, "
              f"{'byte-exact' if exact else 'MISMATCH'}")  # fmt: skip
    finally:
        client.close()
    if daemon.metrics_url != "off":
        deadline = time.monotonic() + 5  # events reach the metrics asynchronously
        values = _scrape(daemon.metrics_url)
        while values[SHOWN_METRICS[-1]] < got and time.monotonic() < deadline:
            time.sleep(0.05)
            values = _scrape(daemon.metrics_url)
        print(f"metrics:  {daemon.metrics_url}")
        for name, value in values.items():
            print(f"          {name} {value:g}")
    return exact and got == n_tokens


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    started = time.perf_counter()
    print("starting: python -m kvcache.server (embedded defaults, free ports) ...", flush=True)
    try:
        daemon = DaemonProcess(echo=args.verbose)
    except DaemonStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with daemon:
        print(f"daemon:   pid {daemon.pid}, zmq {daemon.endpoint}")
        ok = run(daemon)
        if args.keep_running:
            print("daemon still running; Ctrl-C stops it")
            with contextlib.suppress(KeyboardInterrupt):
                daemon.proc.wait()
        rc = daemon.stop()
    print(f"done:     daemon exited with status {rc} after {time.perf_counter() - started:.1f} s")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
