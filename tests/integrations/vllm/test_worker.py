"""The connector's worker half against a real daemon: a failed load never poisons the cache.

No vLLM needed: ``ConnectorWorker`` takes plain ``StepPlan`` values. The scene: the scheduler
planned a load of three chunks (the daemon's lookup said so), but two were evicted before the
load; in the same step vLLM computed a fourth chunk on top of the unfilled blocks, and the
plan stores all four. Before, all four were stored: garbage under the prompt's keys, served to
every other engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.integrations.vllm.plan import RetrieveSpec, StepPlan, StoreSpec
from kvcache.integrations.vllm.worker import ConnectorWorker
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

BS, CS = 4, 16
PROMPT = list(range(500, 500 + 4 * CS))
BLOCKS = list(range(4 * CS // BS))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(["--chunk-size", str(CS), "--l1-size-gb", "0.1"])
    yield d
    d.stop()
    d.remove_runtime_dir()


def _kv(seed: int) -> list[torch.Tensor]:
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                    block_size=BS, num_heads=2, head_size=8, dtype=torch.float16,
                                    seed=seed))  # fmt: skip


def test_a_failed_load_cuts_the_same_steps_store_short(daemon: DaemonProcess) -> None:
    with KVCacheClient(daemon.endpoint, 1, "m", timeout_s=5) as source:
        source.register_kv_caches(_kv(1))
        source.store(PROMPT[:CS], BLOCKS[: CS // BS])  # only the first chunk is still cached
    client = KVCacheClient(daemon.endpoint, 2, "m", timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(2))})
    assert worker.chunk_size == CS
    plan = StepPlan(
        retrieves=[RetrieveSpec("r", PROMPT[: 3 * CS], BLOCKS[: 3 * CS // BS], 0)],
        stores=[StoreSpec("r", PROMPT, BLOCKS, None, "", stored_before=3 * CS)],
    )
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.take_retrieve_errors() == set(BLOCKS[CS // BS : 3 * CS // BS])  # vLLM recomputes
    assert worker.take_failed_async() == frozenset()  # a synchronous load's request runs on
    # The chunk it did copy counts (vLLM keeps it), as the daemon counts it; so does the failure.
    loaded = worker.tally.totals()
    assert loaded["load_tokens"] == CS and loaded["load_bytes"] > 0 and loaded["load_failures"] == 1
    worker.store(plan)
    assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
    assert worker.tally.totals()["stores_poisoned"] == 1
    with KVCacheClient(daemon.endpoint, 3, "m", timeout_s=5) as reader:
        reader.register_kv_caches(_kv(3))
        assert reader.lookup(PROMPT) == CS  # nothing computed on garbage was stored
    assert worker.take_not_stored() == {"r": CS}  # the scheduler plans chunks 2-4 again
    # The next step (planned after vLLM saw the failure, so it recomputes those blocks) stores
    # them, now from the right bytes.
    worker.begin_step(StepPlan(step=2, failures_seen=plan.step))
    worker.store(StepPlan(stores=[StoreSpec("r", PROMPT, BLOCKS, None, "", stored_before=CS)]))
    assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
    assert worker.tally.totals()["stores_poisoned"] == 1 and worker.take_not_stored() == {}
    client.close()


def test_a_failed_store_is_handed_back_to_the_scheduler(daemon: DaemonProcess) -> None:
    client = KVCacheClient(daemon.endpoint, 4, "m", timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(4))})
    worker.begin_step(StepPlan())
    bad = StoreSpec("q", PROMPT, [99] * len(BLOCKS), None, "", stored_before=CS)  # refused ids
    worker.store(StepPlan(stores=[bad]))
    assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
    assert worker.tally.totals()["store_failures"] == 1 and worker.take_not_stored() == {"q": CS}
    client.close()


def test_unfilled_blocks_cut_every_store_until_vllm_has_seen_them(daemon: DaemonProcess) -> None:
    """Blocks a load left unfilled are garbage for every request holding them (vLLM's prefix
    cache shares them), and under async scheduling also in the step planned before vLLM heard
    of the failure: that step's load errors repeat them so vLLM discards what it computed."""
    with KVCacheClient(daemon.endpoint, 5, "m2", timeout_s=5) as source:
        source.register_kv_caches(_kv(5))
        source.store(PROMPT[:CS], BLOCKS[: CS // BS])
    client = KVCacheClient(daemon.endpoint, 6, "m2", timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(6))})
    unfilled = set(BLOCKS[CS // BS : 3 * CS // BS])
    sharer = StoreSpec("s", PROMPT, BLOCKS, None, "", stored_before=0)  # holds r's blocks
    failed = StepPlan(
        retrieves=[RetrieveSpec("r", PROMPT[: 3 * CS], BLOCKS[: 3 * CS // BS], 0)], stores=[sharer], step=1
    )
    worker.begin_step(failed)
    worker.retrieve(failed)
    worker.store(failed)
    assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
    assert worker.take_retrieve_errors() == unfilled and worker.take_failed_step() == 1
    assert worker.take_not_stored() == {"r": CS, "s": CS}
    # Planned before vLLM processed step 1 (async scheduling): still garbage, still reported.
    stale = StepPlan(stores=[sharer], step=2, failures_seen=-1)
    worker.begin_step(stale)
    worker.store(stale)
    assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
    assert worker.take_retrieve_errors() == unfilled and worker.take_not_stored() == {"s": CS}
    with KVCacheClient(daemon.endpoint, 7, "m2", timeout_s=5) as reader:
        reader.register_kv_caches(_kv(7))
        assert reader.lookup(PROMPT) == CS
        # Planned after: vLLM recomputes them in this step, so its stores are right again.
        fresh = StepPlan(
            stores=[StoreSpec("s", PROMPT, BLOCKS, None, "", stored_before=CS)], step=3, failures_seen=1
        )
        worker.begin_step(fresh)
        worker.store(fresh)
        assert worker.wait_stores(None)  # settled: tallies and hand-backs are final
        assert worker.take_retrieve_errors() == set() and worker.take_not_stored() == {}
        assert reader.lookup(PROMPT) == len(PROMPT)
    client.close()


def test_a_rank_that_could_not_register_reports_every_planned_load_as_failed() -> None:
    """The scheduler half may find prefixes through another rank's registration; this rank's
    blocks were never filled, so vLLM must recompute them. An asynchronous load is reported
    done all the same (vLLM would otherwise wait for it forever)."""
    worker = ConnectorWorker(KVCacheClient("ipc:///nonexistent/kvcache.sock", 8, "m", timeout_s=1), BS)
    plan = StepPlan(
        retrieves=[
            RetrieveSpec("s", PROMPT[: 2 * CS], BLOCKS[: 2 * CS // BS], CS // 2),
            RetrieveSpec("a", PROMPT[:CS], [40, 41, 42, 43], 0, is_async=True),
        ],
        step=1,
    )
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.take_retrieve_errors() == set(BLOCKS[CS // 2 // BS : 2 * CS // BS]) | {40, 41, 42, 43}
    assert worker.take_finished_recving() == {"a"}
    assert worker.tally.totals()["load_failures"] == 2
    worker.close()


def _gate_stores(client: KVCacheClient, kind: type = m.Store) -> threading.Event:
    """Hold every request of ``kind`` before it reaches the daemon until the returned event
    is set (bounded: a worker that waits for it where it must not fails its test, never hangs)."""
    gate = threading.Event()

    def gated(body: Any, send: Any) -> Any:
        if isinstance(body, kind):
            gate.wait(5)
        return send(body)

    client.session.intercept(gated)
    return gate


def test_async_stores_release_a_finished_request_only_once_settled(daemon: DaemonProcess) -> None:
    """``store`` returns with the copies still held back; the finished request is reported
    sent (vLLM frees its blocks) only after its store is done, and a failed store releases
    its request too (counted)."""
    client = KVCacheClient(daemon.endpoint, 7, "m4", timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(7))})
    gate = _gate_stores(client)
    worker.begin_step(StepPlan())
    worker.store(StepPlan(stores=[StoreSpec("r", PROMPT, BLOCKS, None, "")]))  # returns: not waited
    bad = StoreSpec("q", PROMPT, [99] * len(BLOCKS), None, "", final=True)  # refused ids
    release = StoreSpec("r", [], [], None, "", final=True)  # r finished: report it once settled
    worker.store(StepPlan(stores=[bad, release]))
    assert worker.take_finished_sending() == set()  # both held at the gate
    held = worker.tally.totals()
    assert (held.get("store_jobs_issued"), held.get("store_jobs_settled", 0)) == (2, 0)  # 2 in flight
    with KVCacheClient(daemon.endpoint, 8, "m4", timeout_s=5) as reader:
        reader.register_kv_caches(_kv(8))
        assert reader.lookup(PROMPT) == 0
        gate.set()
        assert worker.wait_stores(None)
        assert worker.take_finished_sending() == {"r", "q"}
        assert reader.lookup(PROMPT) == len(PROMPT)
    totals = worker.tally.totals()
    assert totals["store_failures"] == 1 and totals["store_tokens"] == len(PROMPT)
    assert totals["store_jobs_issued"] == totals["store_jobs_settled"] == 2
    worker.close()


def test_sync_stores_are_done_when_store_returns(daemon: DaemonProcess) -> None:
    client = KVCacheClient(daemon.endpoint, 9, "m5", timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name, async_stores=False)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(9))})
    worker.store(StepPlan(stores=[StoreSpec("r", PROMPT, BLOCKS, None, "", final=True)]))
    assert worker.take_finished_sending() == {"r"} and worker.tally.totals()["store_tokens"] == len(PROMPT)
    with KVCacheClient(daemon.endpoint, 10, "m5", timeout_s=5) as reader:
        reader.register_kv_caches(_kv(10))
        assert reader.lookup(PROMPT) == len(PROMPT)
    worker.close()


def _loader(
    daemon: DaemonProcess, instance: int, model: str, chunks: int
) -> tuple[KVCacheClient, ConnectorWorker]:
    """A worker on ``model`` whose daemon holds the first ``chunks`` chunks of ``PROMPT``."""
    with KVCacheClient(daemon.endpoint, instance + 100, model, timeout_s=5) as source:
        source.register_kv_caches(_kv(instance + 100))
        source.store(PROMPT[: chunks * CS], BLOCKS[: chunks * CS // BS])
    client = KVCacheClient(daemon.endpoint, instance, model, timeout_s=5)
    worker = ConnectorWorker(client, BS, KVFormat.NL_X_TWO_NB_BS_NH_HS.name)
    worker.register({f"l{i}": t for i, t in enumerate(_kv(instance))})
    return client, worker


def test_an_async_load_is_issued_without_waiting_and_reported_once_settled(daemon: DaemonProcess) -> None:
    """``load`` returns while the copy is held back; the request is reported received (vLLM
    schedules it) only in a step after the copy is done, never before."""
    client, worker = _loader(daemon, 11, "m6", 3)
    gate = _gate_stores(client, m.Retrieve)
    spec = RetrieveSpec("r", PROMPT[: 3 * CS], BLOCKS[: 3 * CS // BS], 0, is_async=True)
    plan = StepPlan(retrieves=[spec], step=1)
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.take_finished_recving() == set() and worker.take_retrieve_errors() == set()
    assert worker.retrieves_in_flight == 1
    worker.begin_step(StepPlan(step=2))
    assert worker.take_finished_recving() == set()  # still held: vLLM keeps it waiting
    gate.set()
    assert worker.wait_retrieves(None)
    worker.begin_step(StepPlan(step=3))
    assert worker.take_retrieve_errors() == set() and worker.take_finished_recving() == {"r"}
    assert worker.take_failed_step() == -1 and worker.take_not_stored() == {}
    assert worker.tally.totals()["load_tokens"] == 3 * CS and worker.retrieves_in_flight == 0
    worker.close()


def test_a_late_async_load_failure_is_reported_with_its_request_in_the_step_that_saw_it(
    daemon: DaemonProcess,
) -> None:
    """Issued in step 1, seen failed in step 3: its unfilled blocks are load errors in the same
    output as its ``finished_recving`` (vLLM truncates the request before scheduling it), and
    they are step 3's failure: stores stay cut until a plan built after vLLM processed step 3."""
    client, worker = _loader(daemon, 12, "m7", 1)  # only the first chunk is still cached
    gate = _gate_stores(client, m.Retrieve)
    unfilled = set(BLOCKS[CS // BS : 3 * CS // BS])
    spec = RetrieveSpec("r", PROMPT[: 3 * CS], BLOCKS[: 3 * CS // BS], 0, is_async=True)
    plan = StepPlan(retrieves=[spec], step=1)
    worker.begin_step(plan)
    worker.retrieve(plan)
    worker.begin_step(StepPlan(step=2))
    assert worker.take_finished_recving() == set() and worker.take_retrieve_errors() == set()
    assert worker.take_failed_step() == -1 and worker.take_failed_async() == frozenset()
    gate.set()
    assert worker.wait_retrieves(None)
    worker.begin_step(StepPlan(step=3, failures_seen=-1))
    assert worker.take_finished_recving() == {"r"}
    assert worker.take_retrieve_errors() == unfilled  # not computed on: named once
    assert worker.take_failed_step() == 3 and worker.take_not_stored() == {"r": CS}
    # Named with its report: the scheduler half offers it no second load (issue 26).
    assert worker.take_failed_async() == frozenset({"r"}) and worker.take_failed_async() == frozenset()
    # Step 4, planned before vLLM processed step 3 (async scheduling): a store over the
    # unfilled blocks is cut; step 5, planned after, is not.
    sharer = StoreSpec("s", PROMPT, BLOCKS, None, "", stored_before=0)
    stale = StepPlan(stores=[sharer], step=4, failures_seen=2)
    worker.begin_step(stale)
    worker.store(stale)
    assert worker.wait_stores(None) and worker.take_not_stored() == {"s": CS}
    assert worker.take_retrieve_errors() == set()
    fresh = StepPlan(stores=[sharer], step=5, failures_seen=3)
    worker.begin_step(fresh)
    worker.store(fresh)
    assert worker.wait_stores(None) and worker.take_not_stored() == {}
    assert worker.tally.totals()["load_failures"] == 1
    worker.close()


def test_a_preempted_requests_load_in_flight_is_waited_for_before_the_step(daemon: DaemonProcess) -> None:
    """vLLM gives a preempted request's blocks to the step's forward: a load still copying into
    them must be over first (``begin_step``), as its stores are."""
    client, worker = _loader(daemon, 13, "m8", 2)
    gate = _gate_stores(client, m.Retrieve)
    spec = RetrieveSpec("p", PROMPT[: 2 * CS], BLOCKS[: 2 * CS // BS], 0, is_async=True)
    plan = StepPlan(retrieves=[spec], step=1)
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.retrieves_in_flight == 1
    opener = threading.Timer(0.3, gate.set)  # the copy is held until after begin_step is called
    opener.start()
    try:
        worker.begin_step(StepPlan(step=2, preempted=["p"]))
        assert worker.retrieves_in_flight == 0, "the step began with the preempted request's load in flight"
    finally:
        opener.cancel()
        gate.set()
    assert worker.take_finished_recving() == {"p"} and worker.take_retrieve_errors() == set()
    worker.close()


def test_an_async_load_that_cannot_be_issued_is_reported_in_the_same_step() -> None:
    worker = ConnectorWorker(KVCacheClient("ipc:///nonexistent/kvcache.sock", 14, "m", timeout_s=1), BS)
    spec = RetrieveSpec("a", PROMPT[:CS], [40, 41, 42, 43], 0, is_async=True)
    plan = StepPlan(retrieves=[spec], step=7)
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.take_finished_recving() == {"a"} and worker.take_retrieve_errors() == {40, 41, 42, 43}
    assert worker.take_failed_step() == 7 and worker.retrieves_in_flight == 0
    assert worker.take_failed_async() == frozenset({"a"})
    worker.close()


def test_a_step_with_no_forward_waits_briefly_for_a_load_to_settle(daemon: DaemonProcess) -> None:
    """With nothing scheduled vLLM steps again at once; the worker blocks (bounded) for the
    first load in flight instead, so the client's thread gets the GIL to finish it."""
    client, worker = _loader(daemon, 15, "m9", 2)
    gate = _gate_stores(client, m.Retrieve)
    spec = RetrieveSpec("r", PROMPT[: 2 * CS], BLOCKS[: 2 * CS // BS], 0, is_async=True)
    plan = StepPlan(retrieves=[spec], step=1)
    worker.begin_step(plan)
    worker.retrieve(plan)
    assert worker.take_finished_recving(idle_wait_s=0.05) == set()  # bounded: still held
    opener = threading.Timer(0.1, gate.set)
    opener.start()
    try:
        assert worker.take_finished_recving(idle_wait_s=5) == {"r"}  # waited for it
    finally:
        opener.cancel()
        gate.set()
    assert worker.take_retrieve_errors() == set()
    worker.close()
