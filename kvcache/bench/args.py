"""Command-line pieces the benchmarks share: ``--quick``.

Separate so that each benchmark (here and in the checkout's ``benchmarks/``) spells the
quick-run rule the same way, from one place.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any


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


__all__ = ["parse_quick"]
