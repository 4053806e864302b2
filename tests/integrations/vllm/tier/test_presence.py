"""The per-chunk answers the tier gives vLLM from the daemon's leading-run answers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.integrations.vllm.tier.presence import presence, prompt_order


def held_by(stored: set[str]) -> tuple[list[int], Callable[[Sequence[str]], int]]:
    """A ``leading_held`` over ``stored``, recording the length of each ask."""
    asks: list[int] = []

    def leading_held(keys: Sequence[str]) -> int:
        asks.append(len(keys))
        run = 0
        for k in keys:
            if k not in stored:
                break
            run += 1
        return run

    return asks, leading_held


def test_a_whole_prefix_is_one_round_trip() -> None:
    asks, fn = held_by({"a", "b", "c"})
    assert presence(["a", "b", "c"], fn) == [True, True, True]
    assert asks == [3]


def test_nothing_held_is_one_round_trip() -> None:
    asks, fn = held_by(set())
    assert presence(["a", "b", "c", "d"], fn) == [False] * 4
    assert asks == [4]


def test_a_gap_of_one_does_not_hide_what_follows() -> None:
    asks, fn = held_by({"a", "b", "d", "e"})
    assert presence(["a", "b", "c", "d", "e", "f"], fn) == [True, True, False, True, True, False]
    assert asks == [6, 3]  # the answer for "d" on says "f" is missing too


def test_a_run_of_misses_ends_the_scan_as_misses() -> None:
    """Cheap over exact: what follows two misses in a row is answered absent (a recompute)."""
    asks, fn = held_by({"a", "d"})
    assert presence(["a", "b", "c", "d"], fn) == [True, False, False, False]
    assert asks == [4, 2]


def test_an_answer_longer_than_asked_is_clamped() -> None:
    assert presence(["a", "b"], lambda keys: 99) == [True, True]
    assert presence(["a", "b"], lambda keys: -3) == [False, False]


def test_prompt_order_follows_recorded_positions() -> None:
    pos = {"c": 48, "a": 16, "b": 32}
    assert prompt_order(["c", "x", "a", "b", "y"], pos.get) == [2, 3, 0, 1, 4]
    assert prompt_order([], pos.get) == []
