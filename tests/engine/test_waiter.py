"""The engine's waiter serves instances in turn: one instance's backlog delays another's next
job by one job, not by the whole backlog (a flood of awaiting retrieves of one tenant)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvcache.engine.waiter import Waiter


def test_instances_take_turns_whatever_one_of_them_queued() -> None:
    gate = threading.Event()
    order: list[str] = []
    done = threading.Event()
    waiter = Waiter(lambda: None, "test-waiter")
    try:
        waiter.add(0, lambda _stop: gate.wait(10))  # holds the thread while the queue fills
        for i in range(50):
            waiter.add(1, lambda _stop, i=i: order.append(f"flood{i}"))
        waiter.add(2, lambda _stop: order.append("victim"))
        waiter.add(2, lambda _stop: done.set())
        gate.set()
        assert done.wait(10)
        assert order.index("victim") == 1  # a FIFO would run it after all 50
        assert [o for o in order if o.startswith("flood")] == [f"flood{i}" for i in range(50)]
    finally:
        gate.set()
        waiter.close()


def test_hand_over_sees_a_fresh_job_of_another_instance_behind_a_backlog_of_handed_ones() -> None:
    """A running job hands the thread over only to a job that never ran; the waiter counts
    those, so the check costs nothing however many handed-over jobs wait."""
    ran = threading.Event()
    handed: list[bool] = []
    fresh_seen, asked = threading.Event(), threading.Event()
    waiter = Waiter(lambda: None, "test-waiter", wake_on_add=True)
    try:

        def first(stop: threading.Event) -> None:
            handed.append(waiter.hand_over(stop))  # nothing fresh yet
            ran.set()
            assert fresh_seen.wait(10)
            handed.append(waiter.hand_over(stop))  # a fresh job of instance 2 waits
            asked.set()

        waiter.add(1, first)
        assert ran.wait(10)
        waiter.add(2, lambda _stop: None)
        fresh_seen.set()
        assert asked.wait(10)
    finally:
        waiter.close()
    assert handed[:2] == [False, True]


def test_a_fresh_job_runs_next_however_many_handed_over_jobs_wait() -> None:
    """Each retrieve awaiting chunks keeps a pass queued on the waiter (handed over: it ran
    and gave the thread to a newer job). A fresh job must run next, not after every handed
    one ran again and handed over in turn: that made each new await cost O(awaits waiting),
    2 million pass runs for a flood of 2,048 awaits."""
    cond = threading.Condition()
    runs: list[str] = []
    release = threading.Event()
    waiter = Waiter(lambda: _notify(cond), "test-waiter", wake_on_add=True)

    def waits(name: str) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:  # as a retrieve's pass: waits, or hands over
            with cond:
                runs.append(name)
                cond.notify_all()
                while not (stop.is_set() or release.is_set()):
                    if waiter.hand_over(stop):
                        return
                    cond.wait()

        return run

    try:
        for i in range(20):
            waiter.add(1, waits(f"pass{i}"))
        with cond:
            assert cond.wait_for(lambda: len(runs) == 20, 10)  # each ran once; the last waits
        waiter.add(1, waits("fresh"))
        with cond:
            assert cond.wait_for(lambda: "fresh" in runs, 10)
            assert runs[20:] == ["fresh"], runs[20:]
    finally:
        release.set()
        _notify(cond)
        waiter.close()


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()
