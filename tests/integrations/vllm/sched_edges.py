"""Scheduler-harness scenarios at the edges of shared loads and of L2 reads (vLLM venv only).

Shared loads (``shared_loads.py``) make requests that need a prefix another request is
loading wait for that load; these scenarios take the leader away while its followers wait:
aborted with its load still held (the followers must not wait for a load nobody will cache),
or its load failing in a small KV cache (the leader is recomputed; the followers load the
prefix, given back to the daemon, or are recomputed, and none is left behind). An L2 whose
reads error (connections dropped, a corrupt value) instead of stalling must fail the load at
once, not at the client's deadline. Registered in ``sched_scenarios.SCENARIOS``; not
collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

from kvcache.testing.redis_local import LocalRedis
from tests.integrations.vllm.redis_gate import RedisReadGate
from tests.integrations.vllm.sched_world import (
    CHUNK,
    Harness,
    ScenarioSkipped,
    first_step,
    hold_loads,
    prompts,
    wait_closed,
    warm,
)

SMALL_CACHE = 26
"""Blocks of a small engine: 25 usable, so a 17-block request needs more than half."""


def _needs_async_loads(h: Harness) -> None:
    if not h.async_loads:
        raise ScenarioSkipped("synchronous loads: nobody waits for another request's load")


def _record_loads(state: dict[str, Any]) -> Any:
    def hook(step: int, out: Any) -> None:
        for load in out.kv_connector_metadata.plan.retrieves:
            state.setdefault("loads", []).append((step, load.req_id, len(load.block_ids)))
            state.setdefault("targets", {})[load.req_id] = list(load.block_ids)

    return hook


def shared_leader_aborted(h: Harness) -> None:
    """``s0``, ``s1`` and ``s2`` share a 192-token prefix the daemon holds and arrive together:
    ``s0`` loads it (its load held back before the daemon), the others wait for that load.
    ``s0`` is aborted: vLLM keeps its blocks until its load is reported, but never caches them,
    so the followers must not wait for it: ``s1`` loads the prefix itself, ``s2`` shares
    ``s1``'s load, and both finish while ``s0``'s load is still held. Released, it is reported
    and only then are ``s0``'s blocks anybody else's."""
    _needs_async_loads(h)
    shared = prompts(110, 200, [0])[0][:192]
    warm(h, ("warm", [*shared, 5, 5, 5]))
    eng = h.engine(max_batched=1024)
    gate = hold_loads(eng.worker.client, {"s0"})
    state: dict[str, Any] = {}
    eng.between_schedule_and_load = _record_loads(state)

    def abort_then_release(step: int) -> None:
        if "s0" in state.get("targets", {}) and "aborted" not in state:
            eng.abort("s0")
            state["aborted"] = step
        elif "aborted" in state and not gate.is_set():
            followers_done = all(eng.requests[r].is_finished() for r in ("s1", "s2"))
            if followers_done or step >= state["aborted"] + 40:
                state.update(opened=step, followers_done=followers_done)
                gate.set()
                assert eng.worker.wait_for_retrieves(30), "the held load never settled"

    eng.before_schedule = abort_then_release
    for i in range(3):
        eng.add(f"s{i}", [*shared, *range(400 + 10 * i, 410 + 10 * i)], 4)
    try:
        eng.run()
    finally:
        gate.set()
    reported = first_step(eng, lambda s: "s0" in s.recving)
    targets = set(state.get("targets", {}).get("s0", []))
    held = [s for s in eng.steps if s.step <= reported]
    overlaps = [(s.step, r) for s in held for r, b in s.blocks.items() if targets & set(b)]
    state.update(reported=reported, overlaps=overlaps, planned=dict(eng.planned_loads))
    state.pop("targets", None)
    h.facts.update(state)
    assert state.get("followers_done"), f"the followers waited for the aborted leader's load: {state}"
    assert reported >= state["opened"], state
    assert not overlaps, f"s0's blocks were scheduled for others before its load was reported: {state}"
    assert eng.planned_loads.get("s1") == 192 and "s2" not in eng.planned_loads, state
    h.check(eng)


def shared_leader_fails(h: Harness) -> None:
    """As above in a small KV cache (each request needs 17 of its 25 blocks), but ``s0``'s
    load fails: the daemon restarts empty while it is held. ``s0`` is recomputed (never
    offered the load again: vLLM 0.32 would leave it behind, docs/vllm.md). The prefix is
    then given back to the daemon; ``s1``, which waited for ``s0``'s load, loads it, and
    ``s2`` shares it. Nobody is left behind and every byte served is right."""
    _needs_async_loads(h)
    prefix = prompts(111, 8 * CHUNK, [0])[0]
    warm(h, ("warm", [*prefix, 3]))
    eng = h.engine(max_batched=1024, num_blocks=SMALL_CACHE)
    gate = hold_loads(eng.worker.client, {"s0"})
    state: dict[str, Any] = {}
    eng.between_schedule_and_load = _record_loads(state)

    def fail_then_give_back(step: int) -> None:
        if "s0" in state.get("targets", {}) and "restarted" not in state:
            h.daemon.restart()
            state["restarted"] = step
        elif "restarted" in state and not gate.is_set() and step >= state["restarted"] + 2:
            state["opened"] = step
            gate.set()
            assert eng.worker.wait_for_retrieves(30), "the held load never settled"
        elif gate.is_set() and "given_back" not in state and eng.tally().get("load_failures", 0):
            h.reader.store_oracle("", prefix)
            state["given_back"] = step
            wait_closed(eng.sched_connector.client)

    eng.before_schedule = fail_then_give_back
    for i in range(3):
        eng.add(f"s{i}", [*prefix, *range(500 + 10 * i, 505 + 10 * i)], 4)
    try:
        eng.run()
    finally:
        gate.set()
    loads = [(r, n) for _, r, n in state.get("loads", [])]
    state.pop("targets", None)
    state["tally"] = {k: eng.tally().get(k, 0) for k in ("load_failures", "load_tokens")}
    h.facts.update(state)
    assert "given_back" in state, f"s0's load did not fail: {state}"
    assert [r for r, _ in loads].count("s0") == 1, f"s0 was offered its failed load again: {state}"
    for client in (eng.sched_connector.client, eng.worker.client):
        wait_closed(client)
    h.check(eng)


def _redis_l2(h: Harness) -> tuple[RedisReadGate, Any]:
    """The harness's daemon replaced by one whose L2 is a real Redis behind a ``RedisReadGate``;
    the gate and a client of the Redis itself."""
    if shutil.which("redis-server") is None:
        raise ScenarioSkipped("redis-server is not installed")
    import redis as redis_py

    server = LocalRedis().start()
    h.cleanups.append(server.close)
    gate = RedisReadGate(server)
    h.cleanups.insert(0, gate.close)
    h.replace_daemon(["--l2-redis-url", gate.url, "--l2-redis-trust-all", "--l2-redis-timeout", "30",
                      "--l2-retry-interval", "0.2"])  # fmt: skip
    return gate, redis_py.Redis.from_url(server.url)


def l2_read_errors(h: Harness) -> None:
    """The prefix (8 chunks) is only in a Redis L2 whose reads error: first every ``GET``
    drops its connection, then (reads healthy again, the daemon restarted) one stored value
    is corrupt. The lookup finds the chunks (``EXISTS`` passes), the load fails at once (all
    of it, then from the corrupt chunk on), not at the client's 10 s deadline: the engine
    goes on, the request is recomputed, and what is stored afterwards is right."""
    gate, raw = _redis_l2(h)
    prefix = prompts(112, 8 * CHUNK, [0])[0]
    warm(h, ("warm", [*prefix, 3]))
    for round_, how in enumerate(("dropped", "corrupt")):
        h.daemon.restart(graceful=True)  # L1 empty: the prefix is only in Redis
        if how == "dropped":
            gate.fail_reads()
        else:
            gate.fail_reads(False)
            name = sorted(raw.keys("kvcache:*"))[0]
            value = raw.get(name)
            raw.setrange(name, len(value) - 1, bytes([value[-1] ^ 0xFF]))
        eng = h.engine()
        req_id = f"r_{how}"
        eng.add(req_id, [*prefix, 7, 8, round_], 4)
        t0 = time.monotonic()
        eng.run()
        tally = eng.tally()
        h.facts[how] = {
            "seconds": round(time.monotonic() - t0, 2),
            "planned": eng.planned_loads.get(req_id, 0),
            "loaded": tally.get("load_tokens", 0),
            "failures": tally.get("load_failures", 0),
            "worker_breaker_trips": eng.worker.client.breaker.trips,
        }
        facts = h.facts[how]
        # The lookup's answer ends where the tier failed it (the prefetch it starts may fail first).
        assert facts["planned"] >= CHUNK and facts["failures"] == 1, f"no load failed: {facts}"
        assert facts["loaded"] < facts["planned"] and facts["seconds"] < 5, facts
        assert facts["worker_breaker_trips"] == 0, f"the load timed out instead of failing: {facts}"
        # In full: a store that met a chunk an L2 prefetch held LOADING copies it itself when
        # that prefetch fails (``_StoreOp._watch``), so every chunk it was handed is held.
        h.check(eng)
    gate.fail_reads(False)


def restart_while_loading(h: Harness) -> None:
    """The daemon restarts (killed and started again in place, not gone for good) while ``a``'s
    load sits in it, waiting for a Redis read held at the gate: its reply never comes, the
    load fails as soon as the old daemon's process has exited (the client's deadline, 1 s,
    is the fallback) and ``a`` is recomputed, the engine going on meanwhile (asynchronous
    loads) or waiting for that (synchronous ones). The same engine's
    clients then register again with the new daemon: ``b``, arriving after (vLLM's prefix
    cache emptied), finds the prefix in the daemon and loads it."""
    gate, _ = _redis_l2(h)
    prefix = prompts(113, 8 * CHUNK, [0])[0]
    warm(h, ("warm", [*prefix, 3]))
    h.daemon.restart(graceful=True)  # L1 empty: the prefix is only in Redis
    gate.hold()  # the lookup's prefetch waits at the gate, and a's load waits for it
    eng = h.engine(timeout_s=1.0)
    state: dict[str, Any] = {}
    restarters: list[threading.Timer] = []

    def restart() -> None:
        state["killed_at"] = round(time.monotonic() - state["t0"], 2)
        h.daemon.restart()
        gate.release()
        state["restarted_at"] = round(time.monotonic() - state["t0"], 2)

    def restart_soon(step: int, out: Any) -> None:
        if "planned" not in state and out.kv_connector_metadata.plan.retrieves:
            state.update(planned=step, t0=time.monotonic())
            restarters.append(threading.Timer(0.2, restart))  # a's load is in the daemon by then
            restarters[0].start()

    eng.between_schedule_and_load = restart_soon
    eng.add("a", [*prefix, 7], 4)
    try:
        eng.run()
    finally:
        ended = time.monotonic()
        for restarter in restarters:  # a may have failed before the new daemon is up
            restarter.join()
        gate.release()
    state["a_seconds"] = round(ended - state.pop("t0", ended), 2)
    state["a_failures"] = eng.tally().get("load_failures", 0)
    assert state["a_failures"] == 1 and not eng.tally().get("load_tokens", 0), f"no failed load: {state}"
    assert state["killed_at"] < 1.0, f"the daemon was killed after a's load had timed out: {state}"
    for client in (eng.sched_connector.client, eng.worker.client):
        wait_closed(client)
    worker = eng.worker.client
    deadline = time.monotonic() + 30
    # Any call of the worker's meets the new daemon's UNKNOWN_INSTANCE and registers it again
    # (its heartbeat would too, later): a lookup shorter than a chunk names no chunk.
    while worker.lookup([0]) or worker.instance_id not in worker.status()["instances"]:
        assert time.monotonic() < deadline, "the worker never registered with the new daemon"
        time.sleep(0.05)
    assert eng.scheduler.reset_prefix_cache(), "vLLM still held blocks"
    eng.add("b", [*prefix, 9, 9], 4)
    eng.run()
    state["b_loaded"] = eng.tally().get("load_tokens", 0)
    h.facts.update(state)
    assert eng.planned_loads.get("b", 0) == 8 * CHUNK and state["b_loaded"] == 8 * CHUNK, state
    h.check(eng)


SCENARIOS = {
    "shared_leader_aborted": shared_leader_aborted,
    "shared_leader_fails": shared_leader_fails,
    "l2_read_errors": l2_read_errors,
    "restart_while_loading": restart_while_loading,
}
NEED_ASYNC_LOADS = {"shared_leader_aborted", "shared_leader_fails"}
"""Run once: with synchronous loads no request waits for another's load."""

__all__ = ["NEED_ASYNC_LOADS", "SCENARIOS"]
