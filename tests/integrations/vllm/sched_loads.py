"""Scheduler-harness scenarios of transfers that outlive their step (vLLM venv only).

Asynchronous loads (``async_loads``, the default) are only issued in ``start_load_kv``; the
request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports its copy settled. These
scenarios hold a load back (``sched_world.hold_loads``) while vLLM keeps stepping, and
check what must not happen meanwhile: the request computing, a late failure reported after
the request was let go, an aborted request's blocks going to another request while the
daemon may still write them, another request's blocks overlapping a loading one's through
preemptions; and that a preempted request's store in flight is over before the forward of
the step that preempted it. Registered in ``sched_scenarios.SCENARIOS``, which also runs the
common checks' engines; not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvcache.protocol import messages as m
from tests.integrations.vllm.sched_world import (
    CHUNK,
    Harness,
    ScenarioSkipped,
    first_step,
    hold_loads,
    prompts,
    warm,
)

BLOCK = 32


def _needs_async_loads(h: Harness, async_scheduling: bool) -> None:
    if not (async_scheduling or h.async_loads):
        raise ScenarioSkipped("synchronous loads: no load outlives its step")


def late_loads(h: Harness, async_scheduling: bool) -> None:
    """Loads outlive their step. ``ok`` and ``bad`` find their prefixes in the daemon and
    their loads are held back while ``d`` keeps decoding; meanwhile the daemon restarts and
    gets all of ``ok``'s prefix back but only the first of ``bad``'s five chunks. Released
    three steps later: each is reported received only then, and scheduled only after that;
    ``bad``'s unfilled blocks are load errors in the output that reports it received (not the
    one that issued the load), vLLM recomputes them, and they are stored right afterwards.
    Reported received at once (before), ``ok`` would compute on blocks not yet filled."""
    _needs_async_loads(h, async_scheduling)
    ok_prompt, bad_prompt = prompts(40, 256, [3])[0], prompts(41, 320, [2])[0]
    warm(h, ("w_ok", ok_prompt), ("w_bad", bad_prompt))
    eng = h.engine(async_scheduling=async_scheduling)
    gate = hold_loads(eng.worker.client, {"ok", "bad"})
    state: dict[str, Any] = {}
    targets: dict[str, list[int]] = {}

    def issued(step: int, out: Any) -> None:
        for load in out.kv_connector_metadata.plan.retrieves:
            targets[load.req_id] = list(load.block_ids)
            state.setdefault("issued", step)

    def arrive_then_release(step: int) -> None:
        if step == 2:
            eng.add("ok", ok_prompt, 4)
            eng.add("bad", bad_prompt, 4)
        elif "issued" in state and not gate.is_set() and step >= state["issued"] + 3:
            h.daemon.restart()
            h.reader.store_oracle("", ok_prompt[: 4 * CHUNK])
            h.reader.store_oracle("", bad_prompt[:CHUNK])
            state["opened"] = step
            gate.set()
            assert eng.worker.wait_for_retrieves(30), "the held loads never settled"

    eng.between_schedule_and_load = issued
    eng.before_schedule = arrive_then_release
    eng.add("d", prompts(42, 30, [0])[0], 50)  # stores its first chunk after the restart
    try:
        eng.run()
    finally:
        gate.set()
    reported = {r: first_step(eng, lambda s, r=r: r in s.recving) for r in ("ok", "bad")}
    computed = {r: first_step(eng, lambda s, r=r: r in s.blocks) for r in ("ok", "bad")}
    unfilled = set(targets.get("bad", [])[CHUNK // BLOCK :])
    state.update(reported=reported, computed=computed)
    h.facts.update(state)
    assert sorted(targets) == ["bad", "ok"] and "opened" in state, state
    assert reported["ok"] == reported["bad"] == state["opened"], state  # not before the gate
    assert computed["ok"] > reported["ok"] and computed["bad"] > reported["bad"], state
    held = range(state["issued"] + 1, state["opened"])
    assert all("d" in eng.steps[i].blocks for i in held), "d did not decode while the loads were held"
    told = [s.step for s in eng.steps if unfilled & s.invalid_block_ids]
    assert told == [reported["bad"]], f"bad's unfilled blocks reported in steps {told}"
    assert unfilled <= eng.steps[reported["bad"]].invalid_block_ids
    assert not eng.wrong_reads(), eng.wrong_reads()  # nothing computed before vLLM knew
    tally = eng.tally()
    # ok's four chunks and the one bad's load did copy (vLLM keeps it: counted, as the daemon does)
    assert tally.get("load_failures", 0) == 1 and tally.get("load_tokens", 0) == 5 * CHUNK, tally
    h.check(eng)  # bad's chunks 2-5 are stored from vLLM's recomputation


def abort_while_loading(h: Harness, async_scheduling: bool) -> None:
    """``a``'s load is held back and ``a`` is aborted: vLLM keeps its blocks until the worker
    reports the load settled. ``b`` (22 of the 25 blocks) can run only in ``a``'s blocks and
    must wait; the load is released after three steps and copies ``a``'s prefix into them,
    then ``b`` runs there. Freed at the abort (the load reported received when issued, as
    before), ``b`` would run in them first and read ``a``'s prefix in its next step."""
    _needs_async_loads(h, async_scheduling)
    prefix = prompts(50, 256, [0])[0]
    warm(h, ("warm", [*prefix, 3]))
    eng = h.engine(async_scheduling=async_scheduling, num_blocks=26, max_batched=1024)
    gate = hold_loads(eng.worker.client, {"a"})
    state: dict[str, Any] = {}
    targets: list[int] = []

    def issued(step: int, out: Any) -> None:
        for load in out.kv_connector_metadata.plan.retrieves:
            if load.req_id == "a":
                state["issued"] = step
                targets.extend(load.block_ids)

    def abort_then_release(step: int) -> None:
        if "issued" in state and "aborted" not in state:
            eng.abort("a")
            eng.add("b", prompts(51, 700, [0])[0], 4)
            state["aborted"] = step
        elif "aborted" in state and not gate.is_set():
            b = eng.requests["b"].num_computed_tokens
            if b >= 600 or step >= state["aborted"] + 3:
                state.update(opened=step, b_computed_at_open=b, a_held_at_open="a" in eng.scheduler.requests)
                gate.set()
                assert eng.worker.wait_for_retrieves(30), "the held load never settled"

    eng.between_schedule_and_load = issued
    eng.before_schedule = abort_then_release
    eng.add("a", [*prefix, 5, 6], 50)
    try:
        eng.run()
    finally:
        gate.set()
    state["reported"] = first_step(eng, lambda s: "a" in s.recving)
    state["b_first"] = b_first = first_step(eng, lambda s: "b" in s.blocks)
    state["reused_blocks"] = len(set(targets) & set(eng.steps[b_first].blocks["b"])) if b_first >= 0 else 0
    h.facts.update(state)
    h.check(eng)  # b's outputs and what it stored: nothing of a's prefix in b's blocks
    assert state.get("b_computed_at_open") == 0 and state["a_held_at_open"], state
    assert state["opened"] <= state["reported"] < b_first, state
    assert state["reused_blocks"] >= 4, f"b did not run in a's blocks: {state}"


def abort_resumed_while_loading(h: Harness) -> None:
    """``p`` stores its first chunks, is preempted (vLLM's prefix cache emptied, so it resumes
    by loading them back from the daemon) and aborted while that load is held. vLLM holds its
    blocks until the load is reported and then frees them; the connector must not hold them
    too for ``p``'s earlier stores (settled at the preemption): it would report them sent at
    once, vLLM would free them while the load may still copy into them, and fail on the
    second report (``_update_from_kv_xfer_finished``)."""
    _needs_async_loads(h, False)
    eng = h.engine()
    gate = hold_loads(eng.worker.client, {"p"})
    state: dict[str, Any] = {}

    def watch(step: int, out: Any) -> None:
        plan = out.kv_connector_metadata.plan
        if "store_step" not in state and any(s.req_id == "p" for s in plan.stores):
            state["store_step"] = step
        if "preempted" in state and any(x.req_id == "p" for x in plan.retrieves):
            state.setdefault("load_step", step)

    def preempt_abort_release(step: int) -> None:
        sched = eng.scheduler
        if "store_step" in state and "preempted" not in state:
            assert eng.worker.wait_for_stores(30)  # resumed, p finds its chunks in the daemon
            sched.running.remove(eng.requests["p"])
            sched._preempt_request(eng.requests["p"], time.monotonic())
            assert sched.reset_prefix_cache(), "vLLM still held blocks"
            state["preempted"] = step
        elif "load_step" in state and "aborted" not in state:
            eng.abort("p")
            state["aborted"] = step
        elif "aborted" in state and not gate.is_set() and step >= state["aborted"] + 2:
            state["opened"] = step
            gate.set()
            assert eng.worker.wait_for_retrieves(30), "the held load never settled"

    eng.between_schedule_and_load = watch
    eng.before_schedule = preempt_abort_release
    eng.add("p", prompts(80, 150, [0])[0], 20)  # stores 128 tokens when its prefill ends
    try:
        eng.run()
    finally:
        gate.set()
    state["reported"] = first_step(eng, lambda s: "p" in s.recving)
    state["released"] = first_step(eng, lambda s: "p" in s.sending)
    h.facts.update(state)
    assert "opened" in state and state["reported"] >= state["opened"], state
    assert state["released"] == -1, f"p was also reported sent: {state}"
    h.check(eng, all_stored=False)  # aborted mid-prompt: what is stored is right


def loading_through_preemptions(h: Harness) -> None:
    """``l``'s load (9 of the 25 blocks) is held back while eight requests fill the other 16
    and grow out of them together: vLLM preempts and resumes them, and no block of ``l``'s
    ever belongs to a scheduled request until ``l`` is reported received; then ``l``
    computes on its loaded prefix."""
    _needs_async_loads(h, False)
    prefix = prompts(60, 256, [0])[0]
    warm(h, ("warm", [*prefix, 3]))
    eng = h.engine(num_blocks=26, max_batched=1024)
    gate = hold_loads(eng.worker.client, {"l"})
    state: dict[str, Any] = {"preempted_while_held": 0, "overlaps": []}
    targets: set[int] = set()

    def watch(step: int, out: Any) -> None:
        for load in out.kv_connector_metadata.plan.retrieves:
            if load.req_id == "l":
                state["issued"] = step
                targets.update(load.block_ids)
        if not targets or any("l" in s.recving for s in eng.steps):
            return
        state["preempted_while_held"] += len(out.preempted_req_ids or ())
        (held,) = eng.scheduler.kv_cache_manager.get_block_ids("l")
        assert targets <= set(held), f"step {step}: l lost blocks while loading"
        for req_id in out.num_scheduled_tokens:
            (blocks,) = eng.scheduler.kv_cache_manager.get_block_ids(req_id)
            if targets & set(blocks):
                state["overlaps"].append((step, req_id))

    def release(step: int) -> None:
        enough = state["preempted_while_held"] >= 2 or step >= state.get("issued", step) + 60
        if "issued" in state and not gate.is_set() and enough:
            state["opened"] = step
            gate.set()
            assert eng.worker.wait_for_retrieves(30), "the held load never settled"

    eng.between_schedule_and_load = watch
    eng.before_schedule = release
    eng.add("l", [*prefix, 5, 6], 8)  # first: 9 blocks, held by its load
    for i in range(8):  # 2 blocks each; all need a third at the same step
        eng.add(f"p{i}", prompts(61 + i, 62, [0])[0], 40)
    try:
        eng.run()
    finally:
        gate.set()
    state["reported"] = first_step(eng, lambda s: "l" in s.recving)
    state["l_first"] = first_step(eng, lambda s: "l" in s.blocks)
    h.facts.update(state)
    assert state["preempted_while_held"] >= 2, f"nothing was preempted while l loaded: {state}"
    assert not state["overlaps"], f"l's blocks were scheduled for others: {state['overlaps']}"
    assert state["opened"] <= state["reported"] < state["l_first"], state
    h.check(eng)


def preempted_store(h: Harness) -> None:
    """``p``'s first store is in flight (slow: held until the next forward starts, or half a
    second) when vLLM preempts ``p``: its blocks are free for the next step's forward, so the
    store must be over before that forward starts. vLLM calls ``start_load_kv`` after the
    forward in a step without synchronous loads, so the wait belongs in
    ``handle_preemptions``."""
    eng = h.engine()
    client = eng.worker.client
    forward_started = threading.Event()
    order: list[str] = []
    state: dict[str, int] = {}

    def slow_store(body: Any, send: Any) -> Any:
        if isinstance(body, m.Store) and body.request_id == "p" and "store_done" not in state:
            forward_started.wait(0.5)  # a slow daemon: the forward goes first if it can
            reply = send(body)
            order.append("store_done")
            state["store_done"] = len(eng.steps)
            return reply
        return send(body)

    client.session.intercept(slow_store)
    forward = eng.forward.forward

    def observed(step: int, out: Any) -> Any:
        if "preempted" in state and step == state["preempted"]:
            order.append("forward")
            forward_started.set()
        return forward(step, out)

    eng.forward.forward = observed  # type: ignore[method-assign]

    def store_planned(step: int, out: Any) -> None:
        if "store_step" not in state and any(s.req_id == "p" for s in out.kv_connector_metadata.plan.stores):
            state["store_step"] = step

    def preempt(step: int) -> None:
        if "store_step" in state and "preempted" not in state:
            sched = eng.scheduler
            request = eng.requests["p"]
            sched.running.remove(request)
            sched._preempt_request(request, time.monotonic())  # as schedule() does, out of memory
            state["preempted"] = step

    eng.between_schedule_and_load = store_planned
    eng.before_schedule = preempt
    eng.add("q", prompts(70, 40, [0])[0], 30)  # keeps running: the preemption step has a forward
    eng.add("p", prompts(71, 150, [0])[0], 20)
    eng.run()
    h.facts.update(state, order=order)
    assert "preempted" in state and "forward" in order, state
    assert order.index("store_done") < order.index("forward"), f"the forward ran first: {order}"
    h.check(eng)


def lone_loads(h: Harness) -> None:
    """The default ``sync_lone_loads``. ``a`` arrives alone with its prefix in the daemon's L1:
    its load is synchronous, planned in the step that computes ``a``, never reported received
    (a step sooner than an asynchronous load, which is scheduled only after the step that
    reports it). ``b`` arrives while ``d`` decodes: its load is asynchronous, ``d``'s steps go
    on, and ``b`` computes only after the step that reports its load received. ``e0``-``e3``
    arrive together, sharing a prefix in L1: ``e0`` loads it synchronously, which lets vLLM
    cache its blocks at once, so the other three find it in vLLM's own prefix cache in the same
    step (no load of their own) and all four compute in that step. ``c`` arrives alone with
    its prefix only on disk (L2, after a restart emptied L1): asynchronous too, as a read from
    a tier could hold the engine's loop for as long as the tier takes."""
    h.replace_daemon(["--l2-disk-path", str(h.workdir / f"l2-{h.name}")])
    pa, pb, pc = (prompts(seed, 4 * CHUNK, [5])[0] for seed in (80, 81, 82))
    pe = prompts(84, 4 * CHUNK, [5, 6, 7, 8])
    warm(h, ("wa", pa), ("wb", pb), ("wc", pc), ("we", pe[0]))
    eng = h.engine(sync_lone_loads=True)
    planned: dict[str, tuple[int, bool]] = {}

    def record(step: int, out: Any) -> None:
        for load in out.kv_connector_metadata.plan.retrieves:
            planned[load.req_id] = (step, load.is_async)

    eng.between_schedule_and_load = record
    eng.add("a", pa, 3)
    eng.run()
    start = len(eng.steps)
    eng.before_schedule = lambda step: eng.add("b", pb, 3) if step == start + 3 else None
    eng.add("d", prompts(83, 40, [0])[0], 12)
    eng.run()
    eng.before_schedule = None
    for i, prompt in enumerate(pe):
        eng.add(f"e{i}", prompt, 3)
    eng.run()
    h.daemon.restart(graceful=True)  # L1 empty; the disk tier keeps c's prefix
    eng.worker.client.lookup([1] * CHUNK)  # the worker re-registers now, not at its next beat
    eng.add("c", pc, 3)
    eng.run()
    names = ["a", "b", "c", "e0", "e1", "e2", "e3"]
    computed = {r: first_step(eng, lambda s, r=r: r in s.blocks) for r in names}
    reported = {r: first_step(eng, lambda s, r=r: r in s.recving) for r in names}
    h.facts.update(planned=planned, computed=computed, reported=reported)
    assert set(planned) == {"a", "b", "c", "e0"}, planned  # d had nothing to load; e1-e3 shared e0's
    for r in ("a", "e0"):
        assert planned[r] == (computed[r], False) and reported[r] == -1, (r, h.facts)
    assert {computed[f"e{i}"] for i in range(4)} == {computed["e0"]}, h.facts
    for r in "bc":
        step, is_async = planned[r]
        assert is_async and step <= reported[r] < computed[r], (r, h.facts)
    assert "d" in eng.steps[planned["b"][0]].blocks, "d's step waited for b's copy"
    assert eng.tally().get("load_tokens", 0) == 4 * 4 * CHUNK, eng.tally()
    h.check(eng)


SCENARIOS = {
    "late_loads_sync": lambda h: late_loads(h, False),
    "late_loads_async": lambda h: late_loads(h, True),
    "abort_while_loading_sync": lambda h: abort_while_loading(h, False),
    "abort_while_loading_async": lambda h: abort_while_loading(h, True),
    "abort_resumed_while_loading": abort_resumed_while_loading,
    "loading_through_preemptions": loading_through_preemptions,
    "preempted_store": preempted_store,
    "lone_loads": lone_loads,
}
"""Scenarios that need asynchronous loads skip themselves in a synchronous-loads run."""

__all__ = ["SCENARIOS"]
