"""``DroppedLoads``: which requests compute at their next admission instead of loading.

The scenarios under vLLM's own scheduler (``sched_failures.py``) show why; here, the rule."""

from __future__ import annotations

from kvcache.integrations.vllm.dropped_loads import DroppedLoads


def test_asked_again_before_it_ran_means_its_load_was_dropped() -> None:
    d = DroppedLoads()
    d.loading("a")
    assert "a" not in d
    assert d.asked("a")  # vLLM asks about it again without having scheduled it
    assert "a" in d and d.asked("a")  # and again while it waits for memory: still no load
    d.admitted("a")
    assert "a" not in d and not d.asked("a")  # the mark did its work


def test_a_request_that_ran_may_load_after_a_preemption() -> None:
    d = DroppedLoads()
    d.loading("a")
    d.ran(["a", "b"])
    assert not d.asked("a")  # preempted and asked again: a load is safe


def test_the_workers_report_marks_too_and_finishing_forgets() -> None:
    d = DroppedLoads()
    d.failed(["f"])
    assert "f" in d and d.asked("f")
    d.loading("g")
    d.forget("f")
    d.forget("g")
    assert "f" not in d and not d.asked("g")  # a reused id starts clean
