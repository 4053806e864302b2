"""``python -m kvcache.bench workload``: a multi-turn chat workload through the daemon and client.

What it answers: with a realistic reuse pattern (a shared system prompt, conversations that
grow turn by turn, new users arriving), what share of prompt tokens each tier serves, how
fast stores and retrieves move bytes, how long lookups take, how much L1 and L2 evict, and
what publishing KV events costs (the same workload runs with KV events off and on, interleaved).

Deterministic: the request sequence depends only on ``--seed`` and the sizes. Each request
does what a serving engine does: ``lookup`` the prompt, ``retrieve`` the hit, then ``store``
prompt + reply. Tier hit rates come from the daemon's own Prometheus counters.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.bench.args import parse_quick
from kvcache.bench.workload_daemon import WorkloadDaemon
from kvcache.bench.workload_report import render
from kvcache.bench.workload_result import RunResult


@dataclass(frozen=True, slots=True)
class Request:
    conversation: int
    prompt: list[int]
    reply: list[int]


def make_requests(args: argparse.Namespace) -> list[Request]:
    """The request sequence: only ``args`` (sizes, probabilities, seed) decide it."""
    rng = random.Random(args.seed)
    system = [rng.randrange(1, 32_000) for _ in range(args.system_prompt_tokens)]
    max_tokens = args.num_blocks * args.block_size
    conversations: dict[int, list[int]] = {}
    out: list[Request] = []
    next_id = 0
    for _ in range(args.requests):
        n_user = rng.randint(args.min_user_tokens, args.max_user_tokens)
        user = [rng.randrange(1, 32_000) for _ in range(n_user)]
        reply = [rng.randrange(1, 32_000) for _ in range(args.reply_tokens)]
        live = [c for c, toks in conversations.items() if len(toks) + len(user) + len(reply) <= max_tokens]
        if live and rng.random() < args.reuse_prob:
            conv = rng.choice(live)
        else:
            conv, next_id = next_id, next_id + 1
            conversations[conv] = list(system)
            if len(conversations) > args.users:  # the oldest user leaves
                del conversations[min(conversations)]
        prompt = conversations[conv] + user
        out.append(Request(conv, prompt, reply))
        conversations[conv] = prompt + reply
    return out


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels folded) from a /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class _EventCounter(threading.Thread):
    """A SUB socket counting KV-event batches and their bytes, so the 'on' run has a real
    consumer and the report can say what an event costs on the wire."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="kv-events-consumer", daemon=True)
        import zmq

        from kvcache.kv_events.messages import batch_decoder

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._decoder = batch_decoder("map")
        self.batches = self.bytes = self.stored = self.stored_blocks = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import zmq

        while not self._halt.is_set():
            if self._sub.poll(50):
                with contextlib.suppress(zmq.Again):
                    while True:  # drain what arrived: one wake-up for a burst, like a router
                        payload = self._sub.recv_multipart(zmq.NOBLOCK)[-1]
                        self.batches += 1
                        self.bytes += len(payload)
                        for ev in self._decoder.decode(payload).events:
                            if type(ev).__name__ == "BlockStored":
                                self.stored += 1
                                self.stored_blocks += len(ev.block_hashes)

    def close(self) -> None:
        self._halt.set()
        self.join(5)
        self._sub.close(0)
        self._ctx.term()


def run_once(
    args: argparse.Namespace, requests: list[Request], kv_events: bool, progress: Any, label: str = ""
) -> RunResult:
    import torch

    from kvcache.client import KVCacheClient
    from kvcache.transport.memfd import empty_shared

    res = RunResult(kv_events)
    with tempfile.TemporaryDirectory(prefix="kvcache-workload-") as tmp:
        flags = ["--chunk-size", str(args.chunk_size), "--l1-size-gb", str(args.l1_gb),
                 "--l2-disk-path", str(Path(tmp) / "l2"),
                 "--l2-disk-size-gb", str(args.l2_disk_gb)]  # fmt: skip
        # The daemon binds a Unix socket (local, so no --kv-events-allow-remote); we connect.
        endpoint = f"ipc://{Path(tmp) / 'kv-events.sock'}" if kv_events else None
        log_path = str(Path(args.out) / f"daemon-kv-events-{'on' if kv_events else 'off'}.log")
        if kv_events and not args.kv_events_token_ids:
            flags.append("--no-kv-events-token-ids")
        daemon = WorkloadDaemon(flags, endpoint, log_path=log_path)
        counter = None
        try:
            daemon.wait_ready()
            cpu0 = daemon.cpu_seconds()
            if endpoint is not None:
                counter = _EventCounter(endpoint)
                counter.start()
            nl, nb, bs, nh, hs = args.layers, args.num_blocks, args.block_size, args.heads, args.head_size
            kv = [empty_shared((2, nb, bs, nh, hs), torch.bfloat16) for _ in range(nl)]
            for t in kv:
                t.normal_()
            bytes_per_token = 2 * nl * nh * hs * 2
            client = KVCacheClient(daemon.endpoint, 0, "bench-model", timeout_s=60.0)
            client.register_kv_caches(kv, block_size=bs)
            blocks = list(range(nb))
            name = label or f"KV events {'on ' if kv_events else 'off'}"
            task = progress.add_task(name, total=len(requests))
            window = max(1, len(requests) // args.windows)
            t_start = time.perf_counter()
            for i, req in enumerate(requests):
                t0 = time.perf_counter()
                hit = client.lookup(req.prompt)
                t1 = time.perf_counter()
                res.lookup_s.append(t1 - t0)
                if hit:
                    got = client.retrieve(req.prompt, blocks)
                    res.retrieve_s += time.perf_counter() - t1
                    res.retrieve_bytes += got * bytes_per_token
                full = req.prompt + req.reply
                t2 = time.perf_counter()
                stored = client.store(full, blocks)
                res.store_s += time.perf_counter() - t2
                res.store_bytes += stored.stored_tokens * bytes_per_token
                res.prompt_tokens += len(req.prompt)
                progress.advance(task)
                if (i + 1) % window == 0 or i + 1 == len(requests):
                    sample = scrape(daemon.metrics_url)
                    sample["t"] = time.perf_counter() - t_start
                    sample["requests"] = i + 1
                    res.windows.append(sample)
            res.seconds = time.perf_counter() - t_start
            cpu1 = daemon.cpu_seconds()
            if cpu0 is not None and cpu1 is not None:
                res.daemon_cpu_s = cpu1 - cpu0
            res.requests = len(requests)
            res.final = res.windows[-1] if res.windows else scrape(daemon.metrics_url)
            client.close()
        finally:
            if counter is not None:
                counter.close()
                res.kv_event_batches = counter.batches
                res.kv_event_bytes = counter.bytes
                res.kv_event_stored, res.kv_event_stored_blocks = counter.stored, counter.stored_blocks
            daemon.stop()
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench workload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small sizes: under a minute on 2 cores")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--users", type=int, default=16, help="conversations alive at once")
    p.add_argument(
        "--reuse-prob", type=float, default=0.8, help="chance a request continues a live conversation"
    )
    p.add_argument("--system-prompt-tokens", type=int, default=1024)
    p.add_argument("--min-user-tokens", type=int, default=64)
    p.add_argument("--max-user-tokens", type=int, default=512)
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="engine blocks (bounds a conversation)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--l1-gb", type=float, default=0.25, help="daemon L1 size (small forces evictions)")
    p.add_argument("--l2-disk-gb", type=float, default=2.0)
    p.add_argument("--windows", type=int, default=20, help="points on the time-series plot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-events-compare", action="store_true", help="skip the KV events on run")
    p.add_argument(
        "--kv-events-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the daemon's --kv-events-token-ids in the 'on' runs (default: on); "
        "compare the reports' KV-event bytes with and without",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run off/on this many times, interleaved (off,on then on,off, ...); the "
        "median run of each mode is reported",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up run (a tenth of the requests) before the timed ones",
    )
    p.add_argument("--out", default="bench-results/workload", help="directory for PNG, JSON, logs")
    return p


QUICK = {"requests": 400, "users": 8, "system_prompt_tokens": 512, "max_user_tokens": 256,
         "reply_tokens": 128, "num_blocks": 256, "layers": 2, "heads": 2, "l1_gb": 0.008,
         "l2_disk_gb": 0.012, "windows": 10, "repeats": 2}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    parser = build_parser()
    args = parse_quick(parser, argv, QUICK)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    console = Console()
    requests = make_requests(args)
    runs: list[RunResult] = []
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    modes = [False] if args.no_kv_events_compare else [False, True]
    with Progress(*cols, console=console) as progress:
        if not args.no_warmup:  # first-run costs (page cache, lazy imports) hit no timed run
            run_once(args, requests[: max(1, len(requests) // 10)], False, progress, "warm-up     ")
        for r in range(max(1, args.repeats)):
            # ABBA order: a drift in machine load over time weighs on both modes alike.
            for mode in modes if r % 2 == 0 else modes[::-1]:
                run = run_once(args, requests, mode, progress)
                run.repeat = r
                runs.append(run)
    render(args, runs, console)
    return 0


__all__ = ["Request", "RunResult", "build_parser", "main", "make_requests"]
