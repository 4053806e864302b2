"""Which of a request's chunks the daemon holds, from "how many leading ones" answers.

The daemon's page lookup (``PageExists``) answers with the length of the leading run of pages
it holds, which is what a prefix needs, while vLLM's tier contract asks about each chunk. Kept
apart (no vLLM, no daemon) so the rule is read and tested on its own:

* the keys are put in prompt order first (vLLM records each key's end-token position), so
  the leading run is the prefix vLLM will load;
* each KV cache group's keys are asked apart (vLLM's key ends in its group index: a hybrid
  model's sliding-window group may lack a chunk its full-attention group holds);
* after a miss the scan goes on past it (a chunk evicted from the middle of a prompt does not
  hide the rest) until a run of none; then the trailing run is asked for, in reverse: a
  sliding-window group holds the end of a prompt, not its start, and vLLM scans it from the end.

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
    """Per key, whether it is held: leading runs forward (at most one round trip per run of
    held keys, plus one), then, where that scan stopped short, the trailing run (one more,
    asked in reverse)."""
    held = [False] * len(keys)
    lo = 0
    while lo < len(keys):
        run = max(0, min(int(leading_held(keys[lo:])), len(keys) - lo))
        held[lo : lo + run] = [True] * run
        if run == 0:
            break
        lo += run + 1  # keys[lo + run] is missing
    if lo < len(keys):  # the scan stopped at a run of none: what does the end hold?
        tail = max(0, min(int(leading_held(keys[lo:][::-1])), len(keys) - lo))
        held[len(keys) - tail :] = [True] * tail
    return held


def presence_by_group(
    keys: Sequence[bytes],
    position: Callable[[bytes], int | None],
    leading_held: Callable[[Sequence[bytes]], int],
) -> list[bool]:
    """``presence`` of each group's keys (grouped by their last 4 bytes) in prompt order,
    answered in the order of ``keys``."""
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(bytes(key[-4:]), []).append(i)
    out = [False] * len(keys)
    for members in groups.values():
        ordered = [members[j] for j in prompt_order([keys[i] for i in members], position)]
        for i, held in zip(ordered, presence([keys[i] for i in ordered], leading_held), strict=True):
            out[i] = held
    return out


__all__ = ["presence", "presence_by_group", "prompt_order"]
