"""Which of a request's chunks the daemon holds, from "how many leading ones" answers.

The daemon's page lookup (``PageExists``) answers with the length of the leading run of pages
it holds, which is what a prefix needs, while vLLM's tier contract asks about each chunk. Kept
apart (no vLLM, no daemon) so the rule is read and tested on its own:

* the keys are put in prompt order first (vLLM records each key's end-token position), so
  the leading run is the prefix vLLM will load;
* after a miss the scan goes on past it once more (a chunk evicted from the middle of a prompt
  does not hide the rest, which a sliding-window model can use), and stops at a run of none.

A chunk reported absent that is held costs a recomputation, never wrong bytes; a chunk
reported held that is not fails its load, which vLLM recomputes too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

K = TypeVar("K")


def prompt_order(keys: Sequence[K], position: Callable[[K], int | None]) -> list[int]:
    """Indices of ``keys`` by recorded position (those without one last, as given)."""
    positions = [position(k) for k in keys]
    return sorted(range(len(keys)), key=lambda i: (positions[i] is None, positions[i] or 0, i))


def presence(keys: Sequence[K], leading_held: Callable[[Sequence[K]], int]) -> list[bool]:
    """Per key, whether it is held, from ``leading_held`` round trips (at most one per run
    of held keys, plus one)."""
    held = [False] * len(keys)
    lo = 0
    while lo < len(keys):
        run = max(0, min(int(leading_held(keys[lo:])), len(keys) - lo))
        held[lo : lo + run] = [True] * run
        if run == 0:
            break
        lo += run + 1  # keys[lo + run] is missing
    return held


__all__ = ["presence", "prompt_order"]
