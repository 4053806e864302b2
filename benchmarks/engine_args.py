"""Command-line pieces the engine benchmarks share: the vLLM benchmarks' model and engines.

Separate so that each engine benchmark spells the model's and the engines' arguments the same
way, from one place (``--quick`` is ``kvcache.bench.args.parse_quick``, shared with the
benchmarks in the package).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.vllm_messages import ModelSpec


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--layers --hidden --heads --kv-heads``: the seeded random LLaMA the driver builds."""
    g = p.add_argument_group("model (a seeded random LLaMA, built locally)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)


def add_engine_args(p: argparse.ArgumentParser, title: str, kv_cache_mb: int,
                    kv_help: str) -> argparse._ArgumentGroup:  # fmt: skip
    """The vLLM engines' and the daemon's arguments every vLLM benchmark takes; the group, for
    a benchmark's own: ``--block-size --chunk-size --kv-cache-mb --torch-threads --vllm-python
    --work-dir --timeout``."""
    g = p.add_argument_group(title)
    g.add_argument("--block-size", type=int, default=32)
    g.add_argument("--chunk-size", type=int, default=256, help="the daemon's chunk (tokens)")
    g.add_argument("--kv-cache-mb", type=int, default=kv_cache_mb, help=kv_help)
    g.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the engines")
    g.add_argument("--vllm-python", help="the vLLM venv's python (default: KVCACHE_VLLM_PYTHON, "
                   "else scripts/vllm_env.sh)")  # fmt: skip
    g.add_argument("--work-dir", help="keep the model and logs here (default: a temporary directory)")
    g.add_argument("--timeout", type=float, default=600, help="seconds an engine start or a command may take")
    return g


@contextmanager
def work_dir(a: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """``--work-dir`` (made if missing, kept), or a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work


def model_spec(a: argparse.Namespace) -> ModelSpec:
    return ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads)


__all__ = ["add_engine_args", "add_model_args", "model_spec", "work_dir"]
