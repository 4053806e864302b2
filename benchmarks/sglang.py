"""``python -m benchmarks.sglang``: SGLang HiCache pages through the daemon, against SGLang's
own file backend, on the same machine in one run.

SGLang's third cache tier takes any ``HiCacheStorage``; the one it ships for a single host is
``HiCacheFile`` (one file per page). This benchmark asks how many pages per second SGLang's
cache controller can set and get through kvcache instead, on SGLang's own host pools and in its
own batches. ``sglang_driver.py`` does the measuring in SGLang's venv (found as the other SGLang
tiers find it, or ``--sglang-python``); this side starts the daemon (its L1 holds every page
stored), hands the driver a ``Spec`` and reports, per round and as the median of rounds:

* kvcache in place (``layer_first`` pool in kvcache memfds) / file backend on ``layer_first``;
* kvcache staged (SGLang's default ``page_first`` pool in its own memory) / file on ``page_first``.

A ratio above 1 means kvcache moves more pages per second. The file backend writes to
``--file-dir`` (default: the system temp directory): it goes through the page cache, without
``fsync``, as SGLang runs it. On a CPU-only machine SGLang cannot import without the test
shims: pass ``--sglang-path tests/integrations/sglang/cishim`` (docs/sglang.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from kvcache.server.launch import DaemonProcess

REPO = Path(__file__).resolve().parents[1]  # the checkout: scripts/ lives there
RATIOS = {"in place / file, layer_first": ("kvcache in place", "file layer_first"),
          "staged / file, page_first": ("kvcache staged", "file page_first")}  # fmt: skip


class Spec(msgspec.Struct, frozen=True):
    """What the driver (``sglang_driver.py``) measures: the arguments, and the daemon's endpoint."""

    endpoint: str
    file_dir: str
    pages: int
    batch: int
    rounds: int
    warmup: int
    layers: int
    heads: int
    head_size: int
    page_size: int


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sglang", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small geometry, 64 pages, one round")
    p.add_argument("--pages", type=int, default=512, help="pages set and got per path and round")
    p.add_argument("--batch", type=int, default=128, help="pages per call (SGLang's controller: 128)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (L1 and page-cache faults)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--file-dir", default=tempfile.gettempdir(), help="where the file backend writes")
    p.add_argument("--sglang-python", help="SGLang's venv python (default: as the SGLang tiers find it)")
    p.add_argument("--sglang-path", action="append", default=[], help="prepended to the driver's PYTHONPATH")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.pages, a.batch, a.rounds, a.warmup = 64, 32, 1, 0
        a.layers, a.heads, a.head_size, a.page_size = 2, 2, 32, 4
    if a.pages % a.batch:
        p.error("--pages must be a multiple of --batch")
    return a


def find_sglang_python() -> str:
    """``$KVCACHE_SGLANG_PYTHON``, else the venv scripts/sglang_env.sh builds or finds."""
    given = os.environ.get("KVCACHE_SGLANG_PYTHON")
    if given:
        return given
    proc = subprocess.run(["bash", str(REPO / "scripts" / "sglang_env.sh")], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"scripts/sglang_env.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def summarize(figures: dict[str, Any]) -> dict[str, Any]:
    """Median pages/s per path and direction; per-round ratios (kvcache / file) and their median."""
    out: dict[str, Any] = {"paths": {}, "ratios": {}}
    for direction in ("set", "get"):
        per_path = figures[f"{direction}_pages_per_s"]
        for path, values in per_path.items():
            out["paths"].setdefault(path, {})[direction] = statistics.median(values)
        for name, (ours, theirs) in RATIOS.items():
            values = [a / b for a, b in zip(per_path[ours], per_path[theirs], strict=True)]
            ratio = {"median": statistics.median(values), "values": values}
            out["ratios"].setdefault(name, {})[direction] = ratio
    return out


def table(summary: dict[str, Any], page_bytes: int) -> str:
    lines = [f"pages of {page_bytes // 1024} KiB; pages/s (median of rounds)",
             f"{'path':<20} {'set':>10} {'get':>10}"]  # fmt: skip
    for path, v in summary["paths"].items():
        lines.append(f"{path:<20} {v['set']:>10.0f} {v['get']:>10.0f}")
    lines.append(f"{'kvcache / file':<30} {'set':>8} {'get':>8}")
    for name, v in summary["ratios"].items():
        lines.append(f"{name:<30} {v['set']['median']:>8.2f} {v['get']['median']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    python = a.sglang_python or find_sglang_python()
    page_bytes = 2 * a.layers * a.page_size * a.heads * a.head_size * 2
    stored = 2 * (a.rounds + a.warmup) * a.pages * page_bytes  # every kvcache page stays in L1
    l1_gb = stored / (1 << 30) * 1.2 + 0.05
    flags = ["--l1-size-gb", f"{l1_gb:.3f}", "--disable-observability"]
    paths = [str(Path(x).resolve()) for x in a.sglang_path]  # the driver runs from /
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO)])}
    t0 = time.monotonic()
    with DaemonProcess(flags) as daemon:
        spec = Spec(daemon.endpoint, a.file_dir, a.pages, a.batch, a.rounds, a.warmup, a.layers, a.heads,
                    a.head_size, a.page_size)  # fmt: skip
        argv = [python, "-m", "benchmarks.sglang_driver", msgspec.json.encode(spec).decode()]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=3600)
        rc = daemon.stop()
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-4000:])
        return 1
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = summarize(figures)
    print(table(summary, figures["page_bytes"]))
    if a.json:
        result = {"args": vars(a), "figures": figures, "summary": summary, "seconds": time.monotonic() - t0,
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}  # fmt: skip
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0 if rc == 0 else 1


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
