"""Alarms: callbacks at set moments on one thread, in deadline order; close runs what is left."""

from __future__ import annotations

import threading

from kvcache.deadline import Deadline
from kvcache.engine.alarms import Alarms


def test_alarms_run_in_deadline_order_off_the_callers_thread() -> None:
    alarms = Alarms("test-alarms", idle_exit_s=0.2)
    ran: list[tuple[str, str]] = []
    done = threading.Event()

    def note(name: str) -> None:
        ran.append((name, threading.current_thread().name))
        if len(ran) == 3:
            done.set()

    alarms.at(Deadline.within(0.15), lambda: note("late"))
    alarms.at(Deadline.within(0.05), lambda: note("early"))
    alarms.at(Deadline.within(0.0), lambda: note("now"))
    assert done.wait(5)
    assert [n for n, _ in ran] == ["now", "early", "late"]
    assert {t for _, t in ran} == {"test-alarms"}


def test_a_cancelled_alarm_never_runs_and_a_broken_one_costs_the_others_nothing() -> None:
    alarms = Alarms("test-alarms")
    ran = threading.Event()
    alarms.at(Deadline.within(0.0), lambda: 1 / 0)  # type: ignore[func-returns-value]
    alarms.at(Deadline.within(0.01), lambda: ran.set()).cancel()
    after = threading.Event()
    alarms.at(Deadline.within(0.05), after.set)
    assert after.wait(5) and not ran.is_set()
    alarms.close()


def test_close_runs_every_pending_alarm_on_the_closing_thread_and_later_ones_at_once() -> None:
    alarms = Alarms("test-alarms")
    ran: list[str] = []
    alarms.at(Deadline.within(60), lambda: ran.append(threading.current_thread().name))
    alarms.close()
    assert ran == [threading.current_thread().name]
    alarms.at(Deadline.within(60), lambda: ran.append("after"))
    assert ran[-1] == "after"


def test_the_thread_leaves_when_idle() -> None:
    alarms = Alarms("test-alarms-idle", idle_exit_s=0.05)
    fired = threading.Event()
    alarms.at(Deadline.within(0.0), fired.set)
    assert fired.wait(5)
    for thread in [t for t in threading.enumerate() if t.name == "test-alarms-idle"]:
        thread.join(5)
    assert not any(t.name == "test-alarms-idle" for t in threading.enumerate())
