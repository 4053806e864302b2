"""The trace bench: the generator is deterministic and follows its parameters; a tiny replay
per policy yields consistent figures (admission writes less, never more, than ``always``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kvcache.bench.workload_trace import build_parser, main, make_trace, run_policy

TINY = ["--sessions", "6", "--concurrent", "3", "--system-tokens", "128", "--decode-tokens", "64", "256",
        "--max-context", "1024", "--l1-mb", "1", "--l2-mb", "2"]  # fmt: skip


def test_trace_depends_only_on_its_parameters_and_follows_them() -> None:
    args = build_parser().parse_args(["--sessions", "40", "--system-prompts", "2", "--system-tokens", "64"])
    a, b = make_trace(args), make_trace(args)
    assert a == b
    args.seed = 1
    assert make_trace(args) != a
    assert {r.session for r in a} == set(range(40))
    heads = {tuple(r.prompt[:64]) for r in a}
    assert len(heads) == 2  # every prompt starts with one of the shared system prompts
    assert all(len(r.prompt) + len(r.reply) <= args.max_context for r in a)
    by_session: dict[int, list[list[int]]] = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r.prompt + r.reply)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi  # multi-turn sessions: a turn's prompt extends the previous turn's context
    assert all(t2[: len(t1)] == t1 for turns in multi for t1, t2 in itertools.pairwise(turns))


def test_a_tiny_replay_per_policy(tmp_path: Path) -> None:
    args = build_parser().parse_args(TINY)
    trace = make_trace(args)
    always = run_policy(args, trace, "always", "lru")
    second = run_policy(args, trace, "second-hit", "s3fifo")
    assert always.prompt_tokens == second.prompt_tokens == sum(len(r.prompt) for r in trace)
    assert always.l2_written_bytes > second.l2_written_bytes > 0
    assert second.l2_declined_bytes > 0 and always.l2_declined_bytes == 0
    assert 0 <= always.l2_hit_rate <= 1 and always.hit_tokens == always.l1_hit_tokens + always.l2_hit_tokens
    out = tmp_path / "r.json"
    assert main([*TINY, "--policies", "always/lru,tinylfu/lru", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["admission"], r["eviction"]) for r in rows] == [("always", "lru"), ("tinylfu", "lru")]
