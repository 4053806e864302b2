"""Runs inside the vLLM venv: the ``SharedPrefix`` command of ``python -m benchmarks.vllm_shared``
on a warm ``vllm_driver`` engine.

Separate from ``vllm_driver.py`` (which dispatches to it) to keep that module one size; it
only drives the engine through the methods every command uses (add, step, settle, the
connector timer), named by ``SteppingEngine`` so that this module needs nothing of vLLM's.
"""

from __future__ import annotations

import random
import time
from typing import Any, Protocol

from benchmarks.vllm_messages import Calls, EngineSpec, SharedPrefix, SharedResult


class ConnectorTimes(Protocol):
    def take(self) -> Calls: ...
    def take_stats(self) -> dict[str, float]: ...


class SteppingEngine(Protocol):
    """What of ``vllm_driver.Engine`` this command uses."""

    spec: EngineSpec

    @property
    def timer(self) -> ConnectorTimes: ...

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], dict[str, Any]]: ...
    def settle(self, within_s: float = 60.0) -> None: ...


def prompts(cmd: SharedPrefix, vocab: int) -> list[list[int]]:
    """The command's prompts: one prefix from the seed, a tail per request (request -1: the
    storing one's), each from the seed and its index, so every mode gets the same tokens."""

    def tokens(key: str, n: int) -> list[int]:
        rng = random.Random(f"{cmd.seed}-{key}")
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = tokens("prefix", cmd.prefix_tokens)
    tails = [-1] if cmd.store else list(range(cmd.requests))
    return [prefix + tokens(f"tail-{i}", cmd.tail_tokens) for i in tails]


def shared_prefix(engine: SteppingEngine, cmd: SharedPrefix) -> SharedResult:
    """Add every prompt, step until each has its one token (``Engine.run``: all are added
    before the first step, so they arrive together), then settle and reset vLLM's prefix cache."""
    batch = prompts(cmd, engine.spec.model.vocab)
    engine.timer.take()
    engine.timer.take_stats()
    t0, steps, reqs = engine.run(batch, max_tokens=1)
    calls = engine.timer.take()
    engine.settle()
    seconds = time.perf_counter() - t0
    done = list(reqs.values())  # in the order added
    return SharedResult(ttft_s=[r["first"] - t0 for r in done], cached_tokens=[r["cached"] for r in done],
                        prompt_tokens=[len(p) for p in batch], first_tokens=[r["tokens"][0] for r in done],
                        seconds=seconds, calls=calls, stats=engine.timer.take_stats(),
                        step_s=steps)  # fmt: skip


__all__ = ["SteppingEngine", "prompts", "shared_prefix"]
