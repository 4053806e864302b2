"""``python -m kvcache.bench trace``: one generated chat trace replayed per L2 policy, in one run.

What it answers: with a bounded L1 and a bounded disk tier, how much each admission policy
(``always``, ``second-hit``, ``tinylfu``) and each eviction policy (``lru``, ``s3fifo``) writes
to L2, how much of that is read back (write amplification: bytes written per byte read), what
hit rate each tier then gives, and what a lookup + retrieve costs (p50/p99).

The trace (no public trace format fits a prefix cache's reuse here, so a generator whose
parameters are the flags; the request sequence depends only on them and ``--seed``):

- ``--system-prompts`` shared system prompts of ``--system-tokens`` tokens; a session picks
  one (the first twice as often as the next, and so on: a few popular prompts);
- ``--sessions`` multi-turn sessions, ``--concurrent`` open at a time, a random open one
  speaking next (their turns interleave, as users do);
- each turn adds ``--user-tokens`` (a range) to the conversation and decodes ``--decode-tokens``
  (a range: long decodes), and the session goes on with probability ``--continue-prob``
  while its context stays under ``--max-context``;
- a request does what a serving engine does: ``lookup`` its prompt (system + history + new
  user text), ``retrieve`` the hit, then ``store`` prompt + decoded reply when it finishes.

The decoded tokens of a session's last turn are stored and never read again: the traffic an
admission policy should keep off L2. Every store is flushed to the tiers before the next
request (so hit rates depend only on the trace and the policies, not on thread timing).
Latencies are of one process on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.observability.event import Event, EventType
from kvcache.testing import make_kv_caches

BLOCK = 16
POLICIES = (
    ("always", "lru"),
    ("second-hit", "lru"),
    ("tinylfu", "lru"),
    ("always", "s3fifo"),
    ("second-hit", "s3fifo"),
)


@dataclass(frozen=True, slots=True)
class Request:
    session: int
    prompt: list[int]
    reply: list[int]


def make_trace(args: argparse.Namespace) -> list[Request]:
    """The request sequence: only ``args`` decide it."""
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(1, 32_000) for _ in range(args.system_tokens)] for _ in range(args.system_prompts)
    ]
    weights = [1 / (i + 1) for i in range(len(systems))]
    lo_u, hi_u = args.user_tokens
    lo_d, hi_d = args.decode_tokens
    open_: dict[int, list[int]] = {}
    started = 0
    out: list[Request] = []
    while open_ or started < args.sessions:
        while len(open_) < args.concurrent and started < args.sessions:
            open_[started] = list(rng.choices(systems, weights)[0])
            started += 1
        sid = rng.choice(sorted(open_))
        history = open_[sid]
        prompt = history + [rng.randrange(1, 32_000) for _ in range(rng.randint(lo_u, hi_u))]
        reply = [rng.randrange(1, 32_000) for _ in range(rng.randint(lo_d, hi_d))]
        prompt, reply = prompt[: args.max_context], reply[: max(0, args.max_context - len(prompt))]
        out.append(Request(sid, prompt, reply))
        nxt = prompt + reply
        if rng.random() < args.continue_prob and len(nxt) + hi_u + hi_d <= args.max_context:
            open_[sid] = nxt
        else:
            del open_[sid]
    return out


class _Tally:
    """An event sink that adds up L2 bytes written and read (the tiers' own events)."""

    def __init__(self) -> None:
        self.written = self.read = self.declined = 0

    def publish(self, event: Event) -> None:
        kind = event.event_type
        if kind is EventType.L2_STORE_FINISHED:
            self.written += event.metadata.num_bytes  # type: ignore[attr-defined]
        elif kind is EventType.L2_LOAD_FINISHED:
            self.read += event.metadata.num_bytes  # type: ignore[attr-defined]
        elif kind is EventType.L2_STORE_DECLINED:
            self.declined += event.metadata.num_bytes  # type: ignore[attr-defined]


@dataclass(slots=True)
class PolicyResult:
    admission: str
    eviction: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    l2_written_bytes: int
    l2_read_bytes: int
    l2_declined_bytes: int
    lookup_retrieve_p50_ms: float
    lookup_retrieve_p99_ms: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def l2_hit_rate(self) -> float:
        """Of the prompt tokens L1 missed, the share L2 served."""
        return self.l2_hit_tokens / max(1, self.prompt_tokens - self.l1_hit_tokens)

    @property
    def write_amplification(self) -> float:
        """L2 bytes written per L2 byte read back."""
        return self.l2_written_bytes / max(1, self.l2_read_bytes)


def _chunk_bytes(args: argparse.Namespace) -> int:
    """Bytes of one chunk of the bench's cache: 2 layers, K and V, 2 heads of 32, bf16."""
    return 2 * 2 * args.chunk_size * 2 * 32 * 2


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3 if s else 0.0


def run_policy(args: argparse.Namespace, trace: list[Request], admission: str, eviction: str) -> PolicyResult:
    """Replay ``trace`` on a fresh engine (empty L1, empty disk tier) with these policies."""
    tally = _Tally()
    max_tokens = max(len(r.prompt) + len(r.reply) for r in trace)
    blocks = -(-max_tokens // BLOCK)
    with tempfile.TemporaryDirectory(prefix="kvcache-trace-") as tmp:
        cfg = EngineConfig(
            chunk_size=args.chunk_size,
            l1_size_bytes=int(args.l1_mb * (1 << 20)),
            l1_extent_bytes=1 << 20,
            l1_pin_memory=False,
            l1_eviction=eviction,
            l2_disk_path=str(Path(tmp) / "disk"),
            l2_disk_size_bytes=int(args.l2_mb * (1 << 20)),
            l2_disk_eviction=eviction,
            l2_disk_admission=admission,
            l2_admission_window=args.window or max(1, int(args.l2_mb * (1 << 20)) // _chunk_bytes(args)),
        )
        lat: list[float] = []
        hit = l1 = l2 = prompt_tokens = 0
        with CacheEngine(cfg, bus=tally) as engine:
            caches = make_kv_caches(KVFormat.NL_X_NB_TWO_BS_NH_HS, num_layers=2, num_blocks=blocks,
                                    block_size=BLOCK, num_heads=2, head_size=32, seed=1)  # fmt: skip
            engine.register(1, "trace-model", caches)
            ids = list(range(blocks))
            for req in trace:
                t0 = time.perf_counter()
                found = engine.lookup_tiers(1, req.prompt)
                if found.hit_tokens:
                    engine.retrieve(1, req.prompt[: found.hit_tokens], ids[: -(-found.hit_tokens // BLOCK)])
                lat.append(time.perf_counter() - t0)
                prompt_tokens += len(req.prompt)
                hit += found.hit_tokens
                l2 += found.l2_hit_tokens
                l1 += found.hit_tokens - found.l2_hit_tokens
                tokens = req.prompt + req.reply
                engine.store(1, tokens, ids[: -(-len(tokens) // BLOCK)])
                engine.flush(30)
    return PolicyResult(
        admission, eviction, len(trace), prompt_tokens, hit, l1, l2, tally.written, tally.read,
        tally.declined, _pct(lat, 0.5), _pct(lat, 0.99),
    )  # fmt: skip


def render(results: list[PolicyResult]) -> str:
    base = results[0]
    rows = [
        "| admission | eviction | hit rate | L1 hit rate | L2 hit rate (of L1 misses) | L2 written MiB "
        "| vs always | L2 read MiB | write amp. | p50 / p99 lookup+retrieve ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.admission} | {r.eviction} | {r.hit_rate:.3f} "
            f"| {r.l1_hit_tokens / max(1, r.prompt_tokens):.3f} "
            f"| {r.l2_hit_rate:.3f} | {r.l2_written_bytes / 2**20:.1f} "
            f"| {base.l2_written_bytes / max(1, r.l2_written_bytes):.2f}x fewer "
            f"| {r.l2_read_bytes / 2**20:.1f} | {r.write_amplification:.2f} "
            f"| {r.lookup_retrieve_p50_ms:.2f} / {r.lookup_retrieve_p99_ms:.2f} |"
        )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench trace", description=__doc__.split("\n\n")[0])
    t = p.add_argument_group("trace")
    t.add_argument("--system-prompts", type=int, default=4)
    t.add_argument("--system-tokens", type=int, default=512)
    t.add_argument("--sessions", type=int, default=200)
    t.add_argument("--concurrent", type=int, default=12)
    t.add_argument("--user-tokens", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    t.add_argument("--decode-tokens", type=int, nargs=2, default=(256, 1536), metavar=("MIN", "MAX"))
    t.add_argument("--continue-prob", type=float, default=0.6)
    t.add_argument("--max-context", type=int, default=6144)
    t.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk (32 KiB each here)")
    e.add_argument("--l1-mb", type=float, default=16.0)
    e.add_argument("--l2-mb", type=float, default=16.0)
    e.add_argument("--window", type=int, default=0,
                   help="--l2-admission-window (default: the disk tier's capacity in chunks)")  # fmt: skip
    p.add_argument("--policies", default=",".join(f"{a}/{e}" for a, e in POLICIES),
                   help="admission/eviction pairs, the first is the baseline")  # fmt: skip
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trace = make_trace(args)
    print(f"trace: {len(trace)} requests, {sum(len(r.prompt) for r in trace)} prompt tokens, "
          f"{sum(len(r.reply) for r in trace)} decoded tokens")  # fmt: skip
    results = []
    for pair in args.policies.split(","):
        admission, eviction = pair.split("/")
        results.append(run_policy(args, trace, admission, eviction))
        print(f"  done {pair}", flush=True)
    print(render(results))
    if args.json:
        rows = [{**asdict(r), "hit_rate": r.hit_rate, "l2_hit_rate": r.l2_hit_rate,
                 "write_amplification": r.write_amplification} for r in results]  # fmt: skip
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2, default=list))
    return 0


__all__ = ["PolicyResult", "Request", "build_parser", "main", "make_trace", "render", "run_policy"]
