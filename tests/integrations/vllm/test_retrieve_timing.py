"""Which retrieves the scheduler half makes synchronous (``retrieve_timing.RetrieveTiming``).

The scheduler harness runs the rule under vLLM's scheduler (``sched_loads.lone_loads``); these
tests pin each condition on its own, in the order vLLM calls the connector within a step:
``choose`` at the ask, ``admit`` at the allocation, ``planned`` when the step's plan is built,
``finished`` when a request ends.
"""

from __future__ import annotations

from kvcache.integrations.vllm.retrieve_timing import RetrieveTiming


def test_a_lone_request_with_its_prefix_in_l1_loads_synchronously() -> None:
    t = RetrieveTiming(async_loads=True, sync_lone=True)
    assert t.choose("a", l2_tokens=0, retrieves_in_flight=False) is False
    assert t.admit("a") is False
    t.planned()
    t.finished("a")  # the engine is idle again
    assert t.choose("b", l2_tokens=0, retrieves_in_flight=False) is False


def test_a_retrieve_is_asynchronous_while_anything_else_lives_or_loads() -> None:
    t = RetrieveTiming(async_loads=True, sync_lone=True)
    assert t.admit("d") is True  # d: admitted without a retrieve (never asked), it runs
    t.planned()
    assert t.choose("a", 0, False) is True and t.admit("a") is True
    t.planned()
    t.finished("d")
    t.finished("a")
    assert t.choose("b", 0, True) is True  # another request's retrieve is in flight
    assert t.choose("c", 0, False) is False and t.admit("c") is False
    assert t.choose("e", 0, False) is True  # c was admitted before it in this step
    assert t.admit("e") is True
    t.planned()
    t.finished("c")  # e still runs (or waits, preempted): not alone
    assert t.choose("f", 0, False) is True


def test_a_retrieve_from_l2_or_on_an_older_answer_stays_asynchronous_even_alone() -> None:
    t = RetrieveTiming(async_loads=True, sync_lone=True)
    assert t.choose("a", l2_tokens=256, retrieves_in_flight=False) is True
    assert t.choose("b", l2_tokens=None, retrieves_in_flight=False) is True  # asked steps ago
    assert t.admit("a") is True and t.admit("b") is True


def test_the_choice_is_the_ask_of_this_step() -> None:
    """vLLM asks again while a request waits for memory; the admission follows the ask of its
    step, and a step planned without admitting it forgets the choice."""
    t = RetrieveTiming(async_loads=True, sync_lone=True)
    assert t.choose("a", 0, False) is False
    t.planned()  # a was not admitted
    assert t.admit("b") is True  # never asked in this step: asynchronous, as before
    assert t.choose("a", 0, False) is True and t.admit("a") is True  # b lives now


def test_the_switches() -> None:
    off = RetrieveTiming(async_loads=True, sync_lone=False)
    assert off.choose("a", 0, False) is True and off.admit("a") is True
    sync = RetrieveTiming(async_loads=False, sync_lone=True)
    sync.admit("d")
    assert sync.choose("a", 256, True) is False and sync.admit("a") is False
