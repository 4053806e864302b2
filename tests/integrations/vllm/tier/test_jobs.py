"""The transfer threads: every job ends in exactly one record, whatever its batches do."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvcache.integrations.vllm.tier.jobs import Finished, Job, JobRunner


def job(job_id: int, n: int) -> Job:
    return Job(job_id, list(range(n)), [bytes([i]) for i in range(n)])


def by_id(records: list[Finished]) -> dict[int, Finished]:
    return {r.job_id: r for r in records}


def test_batches_and_outcomes() -> None:
    batches: list[int] = []

    def store(ids: Sequence[int], keys: Sequence[bytes]) -> int:
        batches.append(len(keys))
        return len(keys)

    def load(ids: Sequence[int], keys: Sequence[bytes]) -> int:
        return 1 if ids[0] == 0 else len(keys)  # the first batch of each load stops after one

    runner = JobRunner(store, load, batch=2, max_pending_stores=8)
    runner.submit_store(job(1, 5))
    runner.submit_load(job(2, 5))
    runner.drain()
    done = by_id(runner.take_finished())
    assert batches == [2, 2, 1]
    assert done[1].success and not done[1].is_load and done[1].done == 5
    assert not done[2].success and done[2].is_load and done[2].done == 1  # stopped at the short batch
    assert runner.take_finished() == [] and not runner.busy()
    runner.stop(5)


def test_a_failing_transfer_is_a_failed_job_not_a_lost_one() -> None:
    calls = 0

    def load(ids: Sequence[int], keys: Sequence[bytes]) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("daemon gone")
        return len(keys)

    runner = JobRunner(lambda i, k: len(k), load, batch=2, max_pending_stores=8)
    runner.submit_load(job(7, 6))
    runner.drain()
    (r,) = runner.take_finished()
    assert (r.job_id, r.done, r.total, r.success) == (7, 2, 6, False)
    runner.stop(5)


def test_stores_past_the_bound_fail_at_once_and_drain_waits() -> None:
    gate, started = threading.Event(), threading.Event()

    def store(ids: Sequence[int], keys: Sequence[bytes]) -> int:
        started.set()
        gate.wait(30)
        return len(keys)

    runner = JobRunner(store, lambda i, k: len(k), batch=4, max_pending_stores=2)
    runner.submit_store(job(1, 1))
    runner.submit_store(job(2, 1))
    runner.submit_store(job(3, 1))  # over the bound: failed, never queued
    assert started.wait(30)
    assert [(r.job_id, r.success) for r in runner.take_finished()] == [(3, False)]
    assert runner.refused_stores == 1 and runner.busy()
    drained = threading.Thread(target=runner.drain)
    drained.start()
    drained.join(0.2)
    assert drained.is_alive()  # a running store holds drain
    gate.set()
    drained.join(30)
    assert not drained.is_alive()
    assert sorted((r.job_id, r.success) for r in runner.take_finished()) == [(1, True), (2, True)]
    runner.stop(5)


def test_stop_fails_queued_jobs_with_a_record_each() -> None:
    gate, started = threading.Event(), threading.Event()

    def load(ids: Sequence[int], keys: Sequence[bytes]) -> int:
        started.set()
        gate.wait(30)
        return len(keys)

    runner = JobRunner(lambda i, k: len(k), load, batch=4, max_pending_stores=2)
    runner.submit_load(job(1, 2))
    assert started.wait(30)
    runner.submit_load(job(2, 2))
    stopper = threading.Thread(target=runner.stop, args=(30,))
    stopper.start()
    gate.set()  # the running job completes; the queued one is failed unrun
    stopper.join(30)
    done = by_id(runner.take_finished())
    assert done[1].success and not done[2].success and done[2].done == 0
