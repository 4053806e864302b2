"""Command-line pieces the benchmarks share: ``--quick`` and the vLLM benchmarks' model.

Separate so that each benchmark spells the quick-run rule and the model's arguments the same
way, from one place.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from kvcache.bench.vllm_messages import ModelSpec


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--layers --hidden --heads --kv-heads``: the seeded random LLaMA the driver builds."""
    g = p.add_argument_group("model (a seeded random LLaMA, built locally)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)


def model_spec(a: argparse.Namespace) -> ModelSpec:
    return ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads)


def parse_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                quick: Mapping[str, Any]) -> argparse.Namespace:  # fmt: skip
    """Parse ``argv``; with ``--quick``, ``quick``'s values replace only what the command line
    left at its default."""
    a = parser.parse_args(argv)
    if a.quick:
        defaults = parser.parse_args([])
        for key, value in quick.items():
            if getattr(a, key) == getattr(defaults, key):
                setattr(a, key, value)
    return a


__all__ = ["add_model_args", "model_spec", "parse_quick"]
