"""The per-chunk answers the tier gives vLLM from the daemon's leading-run answers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.integrations.vllm.tier.presence import presence, presence_by_group, prompt_order


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


def test_nothing_held_is_two_round_trips() -> None:
    asks, fn = held_by(set())
    assert presence(["a", "b", "c", "d"], fn) == [False] * 4
    assert asks == [4, 4]  # forward, then the trailing run


def test_a_gap_of_one_does_not_hide_what_follows() -> None:
    asks, fn = held_by({"a", "b", "d", "e"})
    assert presence(["a", "b", "c", "d", "e", "f"], fn) == [True, True, False, True, True, False]
    assert asks == [6, 3]  # the answer for "d" on says "f" is missing too


def test_a_run_of_misses_ends_the_forward_scan_and_the_tail_is_asked() -> None:
    """Cheap over exact: between the forward runs and the trailing run, keys are answered
    absent (a recompute, never wrong bytes)."""
    asks, fn = held_by({"a", "d", "f", "g"})
    assert presence(["a", "b", "c", "d", "e", "f", "g"], fn) == [True, False, False, False, False, True, True]
    assert asks == [7, 5, 5]


def test_a_sliding_window_holds_the_end() -> None:
    asks, fn = held_by({"e", "f"})
    assert presence(["a", "b", "c", "d", "e", "f"], fn) == [False] * 4 + [True, True]
    assert asks == [6, 6]


def test_an_answer_longer_than_asked_is_clamped() -> None:
    assert presence(["a", "b"], lambda keys: 99) == [True, True]
    assert presence(["a", "b"], lambda keys: -3) == [False, False]


def test_prompt_order_follows_recorded_positions() -> None:
    pos = {"c": 48, "a": 16, "b": 32}
    assert prompt_order(["c", "x", "a", "b", "y"], pos.get) == [2, 3, 0, 1, 4]
    assert prompt_order([], pos.get) == []


def test_groups_are_asked_apart_in_prompt_order() -> None:
    """A hybrid model: group 1 (sliding window) lacks the first chunk group 0 holds; asked
    together, the run would stop there; apart, group 0's prefix is whole."""
    g0 = [bytes([i]) * 4 + b"\0\0\0\0" for i in range(3)]
    g1 = [bytes([i]) * 4 + b"\0\0\0\1" for i in range(3)]
    stored = {*g0, g1[1], g1[2]}
    position = {k: 16 * (i + 1) for group in (g0, g1) for i, k in enumerate(group)}
    asked: list[list[bytes]] = []

    def leading_held(keys: Sequence[bytes]) -> int:
        asked.append(list(keys))
        run = 0
        for k in keys:
            if k not in stored:
                break
            run += 1
        return run

    keys = [g0[2], g1[0], g0[0], g1[2], g0[1], g1[1]]  # interleaved, out of order
    assert presence_by_group(keys, position.get, leading_held) == [True, False, True, True, True, True]
    assert asked == [g0, g1, g1[::-1]]  # group 0 whole; group 1 forward, then from its end
