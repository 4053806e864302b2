"""``python -m kvcache.bench noisy``: a victim tenant's latency while another tenant floods.

The daemon is shared infrastructure; its promise is that no principal's work delays another's
by more than a small bound (docs/operator-guide.md, "Fair share"). One real daemon (defaults,
Unix socket and loopback TCP), two principals:

* the **victim**, an engine of the daemon's own user on the Unix socket, runs an ordinary loop
  (store a fresh prompt, look up and retrieve a prompt held in L1) and times each call;
* the **attacker**, a separate process on plain loopback TCP (another principal), pipelines
  one kind of flood at a time as fast as it can: retrieves awaiting a chunk nobody stores
  (``awaits``), stores of fresh prompts (``stores``), long lookups (``lookups``), or idle
  connections up to its cap (``connections``).

Beside the floods, a **reference** (``cpu``): the attacker's process burns one core and never
calls the daemon. What the victim loses to it is what any co-located load costs on this
machine (the kernel shares the cores, not the daemon), the floor a flood's ratio is read
against.

**Placement** (``--placement``): by default (``split``) the attacker's process runs on its
own cores (the upper half) and the daemon and the victim on the rest, as engines run on
cores of their own on a serving host, so a flood's ratio holds what the daemon does for the
flood, not the attacker's own CPU; ``shared`` puts every process on every core (the
reference then burns a core the daemon runs on).

For each flood it reports the victim's p50/p99 per operation with the flood against the same
loop without it, measured in the same run, as a ratio (target: L1-hit retrieve p99 within 2x),
and for awaits how far past its own bound the attacker's last one was answered (target: under
1 s) and how many were refused by its per-principal bounds, and the daemon's resident memory
growth over its start (L1 fills as the victim and a store flood write, up to ``--l1-size-gb``).
A separate process for the attacker, so the victim's timings hold the daemon's cost only, not
the bench's own GIL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import EngineConfig
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.daemon_config import DaemonConfig
from kvcache.server.launch import DaemonProcess
from kvcache.server.registration import Limits
from kvcache.testing import make_kv_caches

BLOCK, CHUNK, BLOCKS = 16, 256, 256  # 16 chunks of 256 tokens fit the engine's blocks
FLOODS = ("awaits", "stores", "lookups", "connections")
COLD_CHUNKS = 16  # the victim's prompt left untouched through a flood (8 MiB, within its L1 share)
REFERENCE = "cpu"  # one core burnt beside the daemon, no request sent: the machine's own floor


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench noisy", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small floods: about a minute on 2 cores")
    p.add_argument("--floods", default=",".join((REFERENCE, *FLOODS)),
                   help=f"which floods, comma-separated ({REFERENCE!r}: the reference)")  # fmt: skip
    p.add_argument("--requests", type=int, default=20000, help="requests per flood (awaits, stores, lookups)")
    p.add_argument("--connections", type=int, default=120, help="idle connections of the connection flood")
    p.add_argument("--await-ms", type=int, default=10000, help="the attacker's await bound")
    p.add_argument("--samples", type=int, default=200, help="victim loop iterations per phase")
    p.add_argument("--placement", choices=("split", "shared"), default="split",
                   help="split: the attacker's process on its own cores, the daemon and the victim on the"
                        " rest (each tenant's engine on its own cores, as on a serving host); shared: every"
                        " process on every core")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.samples, ns.await_ms = (
            min(ns.requests, 5000),
            min(ns.samples, 60),
            min(ns.await_ms, 5000),
        )
    return ns


def _kv(seed: int) -> list[torch.Tensor]:
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=4, num_blocks=BLOCKS,
                                    block_size=BLOCK, num_heads=2, head_size=64, dtype=torch.float16,
                                    seed=seed))  # fmt: skip


def _tokens(base: int, chunks: int) -> list[int]:
    return list(range(base, base + chunks * CHUNK))


# -- the attacker (its own process) ----------------------------------------------------------


def _burn(sent: Any, measured: Any, out: Any) -> None:
    """The reference: keep one core busy, in pure Python, until the victim has measured."""
    sent.set()
    start = time.monotonic()
    while not measured.is_set():
        sum(range(10_000))
    out.put({"refused": 0, "late_s": 0.0, "late_from_start_s": 0.0, "first_await_reply_s": None,
             "send_s": 0.0, "seconds": time.monotonic() - start,
             "attacker_cpus": sorted(os.sched_getaffinity(0))})  # fmt: skip


def _attack(endpoint: str, kind: str, ns: argparse.Namespace, sent: Any, measured: Any, out: Any) -> None:
    if ns.attacker_cpus:
        os.sched_setaffinity(0, ns.attacker_cpus)
    if kind == REFERENCE:
        _burn(sent, measured, out)
        return
    client = KVCacheClient(endpoint, 2, "m", timeout_s=120)
    with client:
        client.register_kv_caches(_kv(2))
        ids = pack_ids(list(range(BLOCKS)))
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        socks = [sock]
        sock.connect(endpoint)
        n = ns.requests
        if kind == "connections":
            for _ in range(ns.connections - 1):
                extra: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                extra.setsockopt(zmq.LINGER, 0)
                extra.connect(endpoint)
                socks.append(extra)
            n = 0
        start = time.monotonic()
        sent_at = [0.0] * n
        for i in range(n):
            sent_at[i] = time.monotonic()
            token = client.session.token
            if kind == "awaits":
                body: m.RequestBody = m.Retrieve(
                    instance_id=2, token_ids=pack_ids(_tokens(10**7, 1)), block_ids=ids, token=token,
                    await_chunks=1, await_ms=ns.await_ms,
                )  # fmt: skip
            elif kind == "stores":
                body = m.Store(instance_id=2, token_ids=pack_ids(_tokens(2 * 10**7 + i * CHUNK, 1)),
                               block_ids=pack_ids(list(range(CHUNK // BLOCK))), token=token)  # fmt: skip
            else:
                body = m.Lookup(instance_id=2, token_ids=pack_ids(_tokens(3 * 10**7 + i, 200)), token=token)
            sock.send(encode_request(i, body))
        sent.set()
        refused, late, late_from_start, first = 0, 0.0, 0.0, None
        for _ in range(n):
            if not sock.poll(max(120_000, 4 * ns.await_ms)):
                break
            reply = decode_reply(sock.recv())
            if isinstance(reply.body, m.Error):
                refused += reply.body.code is m.ErrorCode.LIMIT
            elif kind == "awaits":  # its own wait: from its own send to its reply, past the bound
                now = time.monotonic()
                first = now - start if first is None else first
                late = max(late, now - sent_at[reply.id] - ns.await_ms / 1000)
                late_from_start = max(late_from_start, now - start - ns.await_ms / 1000)
        out.put({"refused": refused, "late_s": late, "late_from_start_s": late_from_start,
                 "first_await_reply_s": first, "send_s": sent_at[-1] - start if n else 0.0,
                 "seconds": time.monotonic() - start,
                 "attacker_cpus": sorted(os.sched_getaffinity(0))})  # fmt: skip
        measured.wait(600)  # the connections stay open until the victim has measured
        for s in socks:
            s.close()


# -- the victim (this process) ---------------------------------------------------------------


def _victim_loop(client: KVCacheClient, samples: int, base: int) -> dict[str, list[float]]:
    held = _tokens(0, 4)
    times: dict[str, list[float]] = {"retrieve": [], "lookup": [], "store": []}
    for i in range(samples):
        # The held prompt is within the victim's share of L1, which no flood evicts; stored
        # again all the same (a no-op while it is held), so the retrieve always times an L1 hit.
        client.store(held, list(range(len(held) // BLOCK)))
        t = time.perf_counter()
        client.store(_tokens(base + i * 4 * CHUNK, 4), list(range(4 * CHUNK // BLOCK)))
        times["store"].append(time.perf_counter() - t)
        t = time.perf_counter()
        client.lookup(held)
        times["lookup"].append(time.perf_counter() - t)
        t = time.perf_counter()
        client.retrieve(held, list(range(len(held) // BLOCK)))
        times["retrieve"].append(time.perf_counter() - t)
    return times


def bound_mib(kind: str) -> float:
    """The most the daemon's memory may grow under one principal's ``kind`` flood with the
    defaults, as docs/operator-guide.md ("Memory under a flood") states it: L1 (shared by
    every principal, filled by the victim's stores too) plus the victim's in-flight share plus
    what the attacker's flood may hold."""
    limits, daemon, conn = Limits(), DaemonConfig(), ConnectionLimits()
    in_flight = daemon.max_in_flight_bytes  # each principal's queued and unanswered messages
    held = {
        REFERENCE: 0,
        "awaits": in_flight + 8 * limits.max_awaited_tokens + 4096 * limits.max_awaiting_retrieves,
        "stores": in_flight,
        "lookups": in_flight,
        "connections": conn.max_connections_per_client * daemon.max_message_bytes,  # unfinished frames
    }[kind]
    return (EngineConfig().l1_size_bytes + in_flight + held) / (1 << 20)


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The daemon's resident memory now (``VmRSS``) or at its peak (``VmHWM``; Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 1024


def _reset_peak(pid: int) -> bool:
    """Start the daemon's peak resident memory (``VmHWM``) afresh from now; False where the
    kernel refuses (then the peak is the daemon's whole life's)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _cpu_s(pid: int) -> float:
    """CPU seconds the daemon has used (user + system, every thread): load on a shared
    machine stretches wall time, not this."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def split_cpus(cpus: set[int]) -> tuple[set[int], set[int]]:
    """The daemon's and the victim's cores, and the attacker's: the attacker gets the upper
    half (at least one core), the rest keep the lower; one core cannot be split."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return set(ordered), set()
    half = len(ordered) // 2
    return set(ordered[:half]), set(ordered[half:])


def run(ns: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"samples": ns.samples, "requests": ns.requests, "await_ms": ns.await_ms}
    own_cpus = os.sched_getaffinity(0)
    ns.attacker_cpus = set()
    if ns.placement == "split":
        served, ns.attacker_cpus = split_cpus(own_cpus)
        os.sched_setaffinity(0, served)  # the daemon, started below, inherits it
    # No log line per operation: the daemon's stderr is read by a thread of this (the
    # victim's) process, and 20,000 lines would time the bench's own GIL, not the daemon.
    d = DaemonProcess(["--chunk-size", str(CHUNK), "--disable-logging"], tcp=True)  # metrics on a free port
    try:
        assert d.ipc_endpoint is not None
        results["placement"] = ns.placement
        results["daemon_cpus"] = sorted(os.sched_getaffinity(d.pid))  # as the kernel holds them
        with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=120) as victim:
            victim.register_kv_caches(_kv(1))
            victim.store(_tokens(0, 4), list(range(4 * CHUNK // BLOCK)))
            _victim_loop(victim, 10, 10**8)  # warm up
            cpu = _cpu_s(d.pid)
            base = _victim_loop(victim, ns.samples, 2 * 10**8)
            victim_cpu_s = (_cpu_s(d.pid) - cpu) / ns.samples  # the daemon's, per victim round
            results["victim_cpu_ms_per_round"] = victim_cpu_s * 1e3
            results["rss_mib"] = _rss_mib(d.pid)
            results["base"] = {
                op: {"p50_ms": _pct(v, 0.5), "p99_ms": _pct(v, 0.99)} for op, v in base.items()
            }
            ctx = mp.get_context("spawn")
            for k, kind in enumerate(ns.floods.split(",")):
                sent, measured, out = ctx.Event(), ctx.Event(), ctx.Queue()
                proc = ctx.Process(target=_attack, args=(d.endpoint, kind, ns, sent, measured, out))
                before, peak_reset = _rss_mib(d.pid), _reset_peak(d.pid)
                cold = _tokens((8 + k) * 10**8, COLD_CHUNKS)  # stored, then left alone
                victim.store(cold, list(range(COLD_CHUNKS * CHUNK // BLOCK)))
                cpu = _cpu_s(d.pid)
                proc.start()
                if not sent.wait(300):
                    raise RuntimeError(f"the {kind} flood was never sent")
                rss = _rss_mib(d.pid)
                flood = _victim_loop(victim, ns.samples, (3 + k) * 10**8)
                rss = max(rss, _rss_mib(d.pid))
                measured.set()
                report = out.get(timeout=max(600, 4 * ns.await_ms / 1000))
                # the flood's own share: the victim's rounds taken off at their unflooded cost, so
                # a flood that costs little (idle connections) may come out below zero: 0
                cpu = max(0.0, _cpu_s(d.pid) - cpu - ns.samples * victim_cpu_s)
                if peak_reset:
                    rss = max(rss, _rss_mib(d.pid, "VmHWM"))
                proc.join(60)
                kept = victim.lookup(cold) // CHUNK  # the flood is over: what it left of the cold prompt
                row: dict[str, Any] = {
                    **report,
                    "rss_mib": rss,  # the daemon's peak during the flood (VmHWM where readable)
                    "rss_growth_mib": rss - results["rss_mib"],  # over its start, earlier floods included
                    "flood_growth_mib": rss - before,  # over the flood's own start
                    "bound_mib": bound_mib(kind),  # what the operator guide allows
                    "cold_kept": kept / COLD_CHUNKS,
                    "daemon_cpu_s": cpu,
                    "cpu_us_per_request": 0.0
                    if kind == REFERENCE
                    else cpu / max(1, ns.requests if kind != "connections" else ns.connections) * 1e6,
                }
                for op, v in flood.items():
                    row[op] = {"p50_ms": _pct(v, 0.5), "p99_ms": _pct(v, 0.99),
                               "p99_ratio": _pct(v, 0.99) / results["base"][op]["p99_ms"]}  # fmt: skip
                results[kind] = row
    finally:
        d.kill()
        d.remove_runtime_dir()
        os.sched_setaffinity(0, own_cpus)
    return results


def main(argv: list[str]) -> int:
    ns = _args(argv)
    results = run(ns)
    if ns.json:
        print(json.dumps(results, indent=1))
        return 0
    base = results["base"]
    attacker = results[ns.floods.split(",")[0]]["attacker_cpus"]  # as its process held them
    print(f"placement {results['placement']}: the daemon and the victim on cpus {results['daemon_cpus']},"
          f" the attacker on cpus {attacker}")  # fmt: skip
    print("victim without a flood (ms): " + ", ".join(
        f"{op} p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f}" for op, v in base.items()))  # fmt: skip
    print(f"{'flood':<12} {'retrieve p50/p99 ms':>20} {'p99 x':>6} {'lookup p99 x':>13} {'store p99 x':>12}"
          f" {'refused':>8} {'late s':>7} {'rss +MiB':>9} {'bound':>7} {'cpu us/req':>10}"
          f" {'cold kept':>9}")  # fmt: skip
    for kind in ns.floods.split(","):
        r = results[kind]
        print(f"{kind:<12} {r['retrieve']['p50_ms']:>9.2f}/{r['retrieve']['p99_ms']:<10.2f}"
              f" {r['retrieve']['p99_ratio']:>6.2f} {r['lookup']['p99_ratio']:>13.2f}"
              f" {r['store']['p99_ratio']:>12.2f} {r['refused']:>8} {r['late_s']:>7.2f}"
              f" {r['rss_growth_mib']:>9.0f} {r['bound_mib']:>7.0f}"
              f" {r['cpu_us_per_request']:>10.0f} {r['cold_kept']:>9.0%}")  # fmt: skip
    print("target: retrieve p99 x <= 2; an await answered at most 1 s past its bound (late s);"
          " rss +MiB (the daemon's peak over its start) within the operator guide's bound;"
          " cold kept: the share of a prompt the victim stored before the flood and left alone"
          " still in L1 after it (a store flood past L1 evicts its own chunks, not those)")  # fmt: skip
    if REFERENCE in results:
        where = "the attacker's core" if results["placement"] == "split" else "a core shared with the daemon"
        print(f"{REFERENCE}: {where} burnt, no request sent: what that load costs the victim on this"
              " machine, the floor for the floods' ratios")  # fmt: skip
    ratios = [r["retrieve"]["p99_ratio"] for k, r in results.items() if k in FLOODS]
    if ratios:
        print(f"median retrieve p99 ratio over floods: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
