"""``python -m benchmarks.vllm_shared``: N requests sharing a prefix held only in L2 (disk),
arriving together, through the real vLLM (issue 22).

Each round, every mode's engine (one per mode for the session, ``vllm_driver`` processes in
the vLLM venv, all on one daemon with a disk L2):

1. **stores** two prefixes, the lone request's and the group's (one request each, untimed;
   vLLM's prefix cache reset after each), then the daemon is stopped (it finishes its L2
   writes as it stops), its chunk files counted, and it is started again over the same disk
   directory and socket directory: L1 is empty, the prefixes are only on disk. The engines
   re-register by themselves (their heartbeat; ``--heartbeat-timeout`` of the daemon); the
   round waits for the daemon's log to show each of them registered again.
2. **times**, mode by mode in an order rotating from round to round: the lone request (the
   lone prefix and a tail of its own), then the N requests (the group's prefix, a tail each),
   all added before the engine's next step; each is timed from there to its first token.
   The daemon's counters are read around each of the two runs: lookups found in L1 / L2, the
   tokens retrieved from L2, the chunks read from disk (target: one read per chunk).

Modes (``--modes``, of ``benchmarks.vllm.MODES``): ``none`` is vLLM with its own prefix
cache only (the group's first request computes the prefix, the others find it in vLLM's
prefix cache once it is computed); ``connector`` the connector with its defaults (the
pipelined client, ``window`` 32); ``window-1`` the connector with one call at a time;
``connector-b`` a second engine with the defaults (an A/A control: the noise floor). Figures
are ratios within one round: each mode's group p50 over its own lone request (target <= 1.3
for ``connector``), and the modes' group p50s over each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.engine_args import add_engine_args, add_model_args, model_spec, work_dir
from benchmarks.vllm import MODES, _rotated, unavailable
from benchmarks.vllm_engines import EngineProcess, engine_env, engines, find_vllm_python, make_model
from benchmarks.vllm_messages import EngineSpec, ModelSpec, SharedPrefix, SharedResult, ZeroKV
from benchmarks.vllm_shared_report import COUNTERS, summarize, table
from kvcache.bench.args import parse_quick
from kvcache.bench.workload import scrape
from kvcache.server.launch import DaemonProcess


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_shared", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a short run: 2 rounds (the sizes of the target)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (>= 5 for a figure)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--modes", default="none,connector,window-1", help=f"of {','.join(MODES)}")
    p.add_argument("--requests", type=int, default=8, help="requests arriving together")
    p.add_argument("--prefix", type=int, default=4096, help="the shared prefix, tokens")
    p.add_argument("--tail", type=int, default=32, help="each request's own tokens after the prefix")
    add_model_args(p)
    g = add_engine_args(p, "engines and daemon", 0, "vLLM's KV cache per engine (default: the group's "
                        "prompts, each in blocks of its own, with slack)")  # fmt: skip
    g.add_argument("--heartbeat-timeout", type=float, default=6.0,
                   help="the daemon's; an engine notices a restart within a third of it")  # fmt: skip
    g.add_argument("--pause", type=float, default=0.2, help="seconds between two timed runs")
    p.add_argument("--out", metavar="PATH", help="also write raw runs and figures as JSON")
    return p


QUICK = {"rounds": 2}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    a = parse_quick(parser, argv, QUICK)
    a.modes = [m for m in a.modes.split(",") if m]
    for m in a.modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    if len(a.modes) < 2 or len(set(a.modes)) != len(a.modes):
        parser.error("--modes needs two modes or more, each once")
    if a.requests < 2 or a.prefix < a.chunk_size or a.tail < 1 or a.rounds < 1:
        parser.error("need --requests >= 2, --prefix >= --chunk-size, --tail >= 1, --rounds >= 1")
    return a


def sizes(a: argparse.Namespace, model: ModelSpec) -> dict[str, float]:
    """vLLM's KV cache per engine (MiB: the group, each request in blocks of its own, +30 %),
    the daemon's L1 (GiB: one round's stores and loads, +50 %) and disk bound (GiB: every round's)."""
    prompt = (a.prefix + a.tail + a.block_size) * model.kv_bytes_per_token()
    kv_mb = a.kv_cache_mb or int(1.3 * a.requests * prompt / (1 << 20)) + 32
    connectors = sum(MODES[m].extra is not None for m in a.modes)
    per_round = 2 * connectors * a.prefix * model.kv_bytes_per_token() / (1 << 30)
    return {"kv_cache_mb": kv_mb, "l1_gb": 3 * per_round + 0.1,
            "disk_gb": 1.5 * per_round * (a.rounds + a.warmup) + 0.1}  # fmt: skip


class RoundDaemon:
    """The daemon over one disk directory and one socket directory, restarted between the
    store and the timed phase of each round (so its L1 starts empty)."""

    def __init__(self, flags: list[str], runtime_dir: str, disk: Path) -> None:
        self.flags, self.runtime_dir, self.disk = flags, runtime_dir, disk
        self.proc = DaemonProcess(flags, runtime_dir=runtime_dir)

    def restart(self) -> int:
        """Stop (L2 writes finish), start again; the chunk files on disk in between."""
        self.proc.stop()
        chunks = sum(1 for _ in self.disk.rglob("*.kvc"))
        self.proc = DaemonProcess(self.flags, runtime_dir=self.runtime_dir)
        return chunks

    def registrations(self) -> list[int]:
        """Instance ids registered with this daemon process, as its log says, in order."""
        out = []
        for line in list(self.proc.lines):
            if (i := line.find("registered instance ")) >= 0 and "again" not in line:
                out.append(int(line[i + len("registered instance ") :].split()[0]))
        return out

    def wait_registered(self, ids: set[int], within_s: float) -> float:
        """Wait until every engine in ``ids`` registered again; seconds it took."""
        t0 = time.monotonic()
        while not ids <= set(self.registrations()):
            if time.monotonic() - t0 > within_s:
                raise TimeoutError(f"engines {sorted(ids - set(self.registrations()))} did not register "
                                   f"again within {within_s:g} s:\n{self.proc.log[-3000:]}")  # fmt: skip
            time.sleep(0.05)  # the log has no event to wait on
        return time.monotonic() - t0

    def counters(self) -> dict[str, float]:
        got = scrape(self.proc.metrics_url)
        return {k: got.get(k, 0.0) for k in COUNTERS}


def run(a: argparse.Namespace, python: str, work: Path) -> dict[str, Any]:
    """Build the model, start the daemon and one engine per mode, run every round."""
    model = model_spec(a)
    env = engine_env(a.torch_threads)
    model_dir = make_model(python, model, work, env)
    size = sizes(a, model)
    disk, runtime = work / "l2-disk", work / "run"
    disk.mkdir(mode=0o700)
    runtime.mkdir(mode=0o700)
    flags = ["--chunk-size", str(a.chunk_size), "--l1-size-gb", f"{size['l1_gb']:.3f}",
             "--l2-disk-path", str(disk), "--l2-disk-size-gb", f"{size['disk_gb']:.3f}",
             "--heartbeat-timeout", str(a.heartbeat_timeout)]  # fmt: skip
    ids = {m: 1000 + i for i, m in enumerate(a.modes) if MODES[m].extra is not None}
    specs = {}
    for m in a.modes:
        extra = MODES[m].extra
        if extra is not None:  # a key scope per mode: no mode loads what another stored
            extra = {**extra, "instance_id": ids[m], "model_name": f"kvcache-bench-shared-{m}"}
        specs[m] = EngineSpec(model_dir=str(model_dir), model=model, connector=extra, block_size=a.block_size,
                              max_model_len=max(4096, a.prefix + a.tail + 64),
                              kv_cache_mb=int(size["kv_cache_mb"]), name=m)  # fmt: skip
    raw: dict[str, Any] = {"model": model.label(), "sizes": size, "rounds": []}
    env["KVCACHE_RUNTIME_DIR"] = str(runtime)  # the connector's default: the Unix socket there
    daemon = RoundDaemon(flags, str(runtime), disk)
    try:
        with engines(python, specs, env, work, a.timeout) as (running, ready):
            raw["ready"] = msgspec.to_builtins(ready)
            for e in running.values():
                e.ask(ZeroKV(), a.timeout)
            for r in range(a.warmup + a.rounds):
                got = _round(a, r, running, daemon, set(ids.values()))
                if r >= a.warmup:
                    raw["rounds"].append(got)
    finally:
        daemon.proc.stop()
    return raw


def _round(a: argparse.Namespace, r: int, running: dict[str, EngineProcess], daemon: RoundDaemon,
           ids: set[int]) -> dict[str, Any]:  # fmt: skip
    """One round (module docstring): store, restart, then each mode's lone and group runs."""
    lone_seed, group_seed = 2 * r + 1, 2 * r + 2
    t0 = time.monotonic()
    for e in running.values():
        for seed in (lone_seed, group_seed):
            e.ask(SharedPrefix(seed, a.prefix, a.tail, store=True), a.timeout)
    out: dict[str, Any] = {"store_s": time.monotonic() - t0, "disk_chunks": daemon.restart(),
                           "reregister_s": daemon.wait_registered(ids, 120.0), "order": _rotated(a.modes, r),
                           "modes": {}}  # fmt: skip
    for m in out["order"]:
        runs: dict[str, Any] = {}
        for name, seed, n in (("lone", lone_seed, 1), ("group", group_seed, a.requests)):
            time.sleep(a.pause)
            before = daemon.counters()
            reply = running[m].ask(SharedPrefix(seed, a.prefix, a.tail, requests=n), a.timeout)
            assert isinstance(reply, SharedResult), reply
            after = daemon.counters()
            runs[name] = msgspec.to_builtins(reply)
            runs[name]["daemon"] = {k: after[k] - before[k] for k in COUNTERS}
        out["modes"][m] = runs
    out["registrations"] = daemon.registrations()
    shown = ", ".join(f"{m} lone {v['lone']['ttft_s'][0] * 1e3:.0f} ms, group p50 "
                      f"{sorted(v['group']['ttft_s'])[len(v['group']['ttft_s']) // 2] * 1e3:.0f} ms"
                      for m, v in out["modes"].items())  # fmt: skip
    tag = "warm-up" if r < a.warmup else f"round {r - a.warmup + 1}/{a.rounds}"
    print(f"{tag}: {shown}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if why := next((w for m in a.modes if (w := unavailable(m))), None):
        print(f"a mode this checkout's connector cannot run: {why}", file=sys.stderr)
        return 2
    python = a.vllm_python or find_vllm_python()
    load0, t0 = os.getloadavg(), time.monotonic()
    with work_dir(a, "kvcache-bench-vllm-shared-") as work:
        raw = run(a, python, work)
    figures = summarize(
        raw["rounds"], a.requests, a.prefix, a.chunk_size, {m for m in a.modes if MODES[m].extra is not None}
    )
    load1, wall = os.getloadavg(), time.monotonic() - t0
    machine = {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1, "wall_s": wall}
    print(f"model: {raw['model']}; kvcache measured: "
          f"{sorted({r['kvcache_path'] for r in raw['ready'].values()})}")  # fmt: skip
    print(f"machine: {machine['cpus']} CPUs, load average {load0[0]:.2f} at start, "
          f"{load1[0]:.2f} at end; {wall:.0f} s")  # fmt: skip
    print(table(figures, {m: MODES[m].label for m in a.modes}))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "machine": machine, "figures": figures,
                                           "raw": raw}, indent=1))  # fmt: skip
    return 0 if figures["valid"] else 1


__all__ = ["build_parser", "main", "parse_args", "sizes"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
