"""Scenarios for the scheduler-level harness; run in the vLLM venv by ``test_sched_harness.py``.

``python sched_scenarios.py --out result.json [--only NAME ...] [--modes async_loads sync_loads]``
runs each scenario (see ``SCENARIOS``; those of loads outliving their step are in
``sched_loads.py``) against real daemons forked from one zygote, and writes
``{mode: {name: {"ok", "error", "facts"}}}``; mode ``sync_loads`` runs the connector with
``async_loads: false`` (``SYNC_LOADS``). Every scenario checks, besides
its own point:

* every request's output tokens equal the oracle's (the fake model's greedy tokens);
* no step read a wrong context unless vLLM was told that step's load failed for those blocks;
* a third engine (``Reader``) finds every chunk the daemon holds for each finished request's
  tokens, retrieves it, and its bytes equal the oracle's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvcache.integrations.vllm.connector import KVCacheMetadata
from kvcache.protocol import messages as m
from kvcache.server.launch import Spawn
from kvcache.testing.daemon_zygote import Zygote
from kvcache.testing.redis_local import LocalRedis
from tests.integrations.vllm.redis_gate import RedisReadGate
from tests.integrations.vllm.sched_decode import SCENARIOS as DECODE_SCENARIOS
from tests.integrations.vllm.sched_edges import NEED_ASYNC_LOADS as EDGES_NEED_ASYNC_LOADS
from tests.integrations.vllm.sched_edges import SCENARIOS as EDGE_SCENARIOS
from tests.integrations.vllm.sched_engine import Engine, write_model_config
from tests.integrations.vllm.sched_failures import ONCE
from tests.integrations.vllm.sched_failures import SCENARIOS as FAILURE_SCENARIOS
from tests.integrations.vllm.sched_loads import SCENARIOS as LOAD_SCENARIOS
from tests.integrations.vllm.sched_world import (
    CHUNK,
    Facts,
    Harness,
    ScenarioSkipped,
    check_outputs,
    count_sends,
    harness,
    prompts,
    stored_tokens,
    wait_closed,
    wait_for_log,
)

# ------------------------------------------------------------------------------- scenarios


def shared_prefixes(h: Harness, async_scheduling: bool) -> None:
    """Many requests, shared prefixes of odd lengths, chunked prefill (96-token steps), outputs
    crossing chunk boundaries; one ends exactly when its last fed token completes a chunk
    (100 + 29 - 1 = 128), one is aborted mid-decode, more arrive while others run. A second
    engine then loads the prefixes from the daemon."""
    a = prompts(1, 157, [13, 40, 91, 8])
    b = prompts(2, 211, [1, 30, 77])
    first = h.engine(async_scheduling=async_scheduling)
    lengths = [7, 33, 20, 40, 64, 18, 25]
    for i, p in enumerate(a + b):
        first.add(f"r{i}", p, lengths[i])
    first.add("edge", prompts(3, 100, [0])[0], 29)

    def arrivals_and_abort(step: int) -> None:
        if step == 12:
            first.abort("r1")  # 33 tokens wanted; prefill done, decoding
            for i, p in enumerate(prompts(1, 157, [19, 64]) + prompts(2, 211, [5])):
                first.add(f"late{i}", p, 10 + 7 * i)

    first.before_schedule = arrivals_and_abort
    assert first.is_async == async_scheduling
    first.run()
    assert "r1" in first.aborted and len(first.outputs("r1")) < 33
    h.check(first)
    second = h.engine(async_scheduling=async_scheduling)
    for i, p in enumerate(prompts(1, 157, [55, 2]) + prompts(2, 211, [70])):
        second.add(f"s{i}", p, 12)
    second.run()
    h.check(second)
    tally = second.tally()
    h.facts.update(
        loaded_tokens=tally.get("load_tokens", 0), stored_tokens=first.tally().get("store_tokens", 0)
    )
    assert tally.get("load_tokens", 0) >= 128 + 192, "the second engine did not load the shared prefixes"


def failed_load(h: Harness, async_scheduling: bool) -> None:
    """The daemon restarts between the lookup and the load (its L1 is gone), and only the
    first chunk is stored again: the load fills 64 of 320 tokens. Synchronous loads (the sync
    scheduler with ``async_loads: false``): in the same step a second request holding the same
    blocks (vLLM's prefix cache) computes on them and stores its chunks; nothing computed on
    the unfilled blocks may reach the daemon, vLLM recomputes, and the right bytes are stored
    afterwards. Asynchronous loads (the default, and always under async scheduling): the
    failure is reported before anything computes on those blocks."""
    prompt = prompts(4, 300, [30])[0]
    first = h.engine(async_scheduling=async_scheduling)
    first.add("w", prompt, 4)
    first.run()
    h.check(first)
    second = h.engine(async_scheduling=async_scheduling)
    restarted: list[int] = []

    def restart(step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        if restarted or not (isinstance(meta, KVCacheMetadata) and meta.plan.retrieves):
            return
        h.daemon.restart()
        h.reader.store_oracle("", prompt[:CHUNK])
        restarted.append(step)

    second.between_schedule_and_load = restart
    second.add("f", [*prompt, 5, 6, 7], 40)
    second.add("g", [*prompt, 8, 9], 20)
    second.run()
    tally = second.tally()
    h.facts.update(
        tally={k: tally.get(k, 0) for k in ("load_failures", "stores_poisoned", "load_tokens")},
        wrong_reads=len(second.wrong_reads()),
    )
    assert restarted, "no load was planned"
    assert tally.get("load_failures", 0) >= 1
    if async_scheduling or h.async_loads:  # asynchronous loads: nothing computes before vLLM knows
        assert not second.wrong_reads(), second.wrong_reads()
    else:  # the load step's forward read the unfilled blocks, as a real one would
        assert second.wrong_reads(), "the unfilled blocks were never read: the scenario proves nothing"
    h.check(second)


def lora(h: Harness) -> None:
    """The same tokens with and without a LoRA adapter are different KV: no cross hit."""
    from vllm.lora.request import LoRARequest

    sql = LoRARequest("sql", 1, "/adapters/sql")
    prompt = prompts(5, 200, [0])[0]
    first = h.engine()
    first.add("with", prompt, 5, identity="lora=sql", lora_request=sql)
    first.run()
    h.check(first)
    second = h.engine()
    second.add("without", [*prompt, 11], 5)
    second.add(
        "with2", [*prompt, 12], 5, identity="lora=sql", lora_request=LoRARequest("sql", 1, "/adapters/sql")
    )
    second.run()
    h.check(second)
    assert second.planned_loads.get("with2", 0) >= 192
    assert second.planned_loads.get("without", 0) == 0


def multimodal(h: Harness) -> None:
    """Two prompts with the same placeholder tokens and different images: no cross hit."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def image(name: str) -> list[MultiModalFeatureSpec]:
        return [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=name,
                mm_position=PlaceholderRange(offset=10, length=40),
            )
        ]

    prompt = prompts(6, 200, [0])[0]
    prompt[10:50] = [7] * 40
    for round_, (names, n) in enumerate([(["cat"], 5), (["dog", "cat"], 6)]):
        eng = h.engine()
        _multimodal_budget(eng)
        for i, name in enumerate(names):
            eng.add(f"{name}{round_}", [*prompt, n + i], 4, identity=f"image={name}", mm_features=image(name))
        eng.run()
        h.check(eng)
    assert eng.planned_loads.get("dog1", 0) == 0
    assert eng.planned_loads.get("cat1", 0) >= 192


def _multimodal_budget(eng: Engine) -> None:
    """A text model's config gives vLLM no encoder budget; give the scheduler a vision
    model's so it schedules the placeholder tokens (the fake forward needs no encoder)."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    eng.scheduler.max_num_encoder_input_tokens = 4096
    eng.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=4096)


def prompt_embeds(h: Harness) -> None:
    """A prompt given as embeddings is neither looked up nor stored: a token prompt of the
    same ids (zeros, as vLLM fills them) never loads its KV."""
    embeds = torch.randn(200, 128)
    zeros = [0] * 200
    eng = h.engine()
    eng.add("embeds", zeros, 4, identity="embeds", prompt_embeds=embeds)
    eng.run()
    h.check(eng)
    assert h.reader.client.lookup([*zeros, 1]) == 0, "the embeddings' KV was stored under token ids"
    second = h.engine()
    second.add("tokens", zeros, 4)
    second.run()
    h.check(second)
    h.facts["not_cached"] = eng.tally().get("requests_not_cached", 0)
    assert h.facts["not_cached"] >= 1


def preemption(h: Harness) -> None:
    """Too few blocks for four long requests: they wait for memory, and vLLM preempts and
    resumes them. A request is looked up once per admission, not once per step it waits;
    block reports restart with every resumption (every block a scheduled request holds has
    been reported for it since it last got blocks); stores stay right."""
    eng = h.engine(num_blocks=26, max_batched=256)
    reported: dict[str, set[int]] = {}
    pending: list[Any] = []
    client = eng.sched_connector.client
    original = client.report_block_allocations

    def record(records: Any, *, wait: bool = True) -> None:
        pending.extend(records)
        original(records, wait=wait)

    client.report_block_allocations = record  # type: ignore[method-assign]
    lookups = count_lookups(client)

    def check_reports(step: int, out: Any) -> None:
        for req_id in out.preempted_req_ids or ():
            reported.pop(req_id, None)
        for r in pending:
            reported.setdefault(r.req_id, set()).update(r.new_block_ids)
        pending.clear()
        for req_id in out.num_scheduled_tokens:
            (held,) = eng.scheduler.kv_cache_manager.get_block_ids(req_id)
            missing = set(held) - reported.get(req_id, set())
            assert not missing, f"step {step}: blocks {sorted(missing)} of {req_id} never reported"

    eng.between_schedule_and_load = check_reports
    for i, tail in enumerate([3, 17, 41, 66]):  # no shared prefix: 39 blocks wanted, 26 there
        eng.add(f"p{i}", prompts(70 + i, 190, [tail])[0], 80)
    eng.run()
    h.check(eng)
    h.facts["preemptions"] = sum(r.num_preemptions for r in eng.requests.values())
    h.facts["lookups"] = lookups = lookups["per_request"]
    assert h.facts["preemptions"] > 0, "nothing was preempted"
    for req_id, request in eng.requests.items():  # once per admission, not per step waited
        assert lookups.get(req_id, 0) <= 1 + request.num_preemptions, (req_id, lookups)


def count_lookups(client: Any) -> dict[str, Any]:
    """Count the scheduler client's lookup round trips (``trips``, single or batched) and how
    often each request was asked about (``per_request``)."""
    counts: dict[str, Any] = {"trips": 0, "per_request": {}}
    single, batch = client.lookup_tiers, client.lookup_batch

    def asked(req_id: str) -> None:
        counts["per_request"][req_id] = counts["per_request"].get(req_id, 0) + 1

    def count_single(tokens: Any, **kw: Any) -> Any:
        counts["trips"] += 1
        asked(kw["request_id"])
        return single(tokens, **kw)

    def count_batch(items: Any) -> Any:
        counts["trips"] += 1
        for item in items:
            asked(item.request_id)
        return batch(items)

    client.lookup_tiers = count_single
    client.lookup_batch = count_batch
    return counts


def batched_lookups(h: Harness) -> None:
    """Eight requests sharing a 192-token prefix the daemon holds arrive together: the
    scheduler half asks the daemon about all of them in one round trip (``LookupBatch``),
    at the first request vLLM asks about, and each request exactly once; vLLM, asking per
    request over several steps (a 96-token budget), gets each answer from that one trip."""
    warm = h.engine()
    shared = prompts(11, 200, [0])[0][:192]
    warm.add("warm", [*shared, 7, 7, 7], 3)
    warm.run()
    h.check(warm)
    eng = h.engine()
    counts = count_lookups(eng.sched_connector.client)
    for i in range(8):
        eng.add(f"b{i}", [*shared, *range(300 + 10 * i, 310 + 10 * i)], 4)
    eng.run()
    h.check(eng)
    h.facts.update(lookup_trips=counts["trips"], per_request=counts["per_request"],
                   loaded_tokens=eng.tally().get("load_tokens", 0))  # fmt: skip
    assert counts["trips"] == 1, counts
    assert counts["per_request"] == {f"b{i}": 1 for i in range(8)}, counts
    assert h.facts["loaded_tokens"] >= 192, "the shared prefix was not loaded"


def shared_load(h: Harness, async_scheduling: bool) -> None:
    """Four requests sharing a 192-token prefix the daemon holds arrive together, a budget
    big enough to admit them in one step: the prefix is copied once, not four times. With
    asynchronous loads the first one admitted loads it and the others wait (the scheduler
    half answers None) until its load is reported and vLLM cached its blocks; then they find
    it in vLLM's own cache (``shared_loads.py``; without it: 4 copies, ``sched_controls``'
    ``no_shared_loads``). With synchronous loads vLLM itself schedules the others on the
    first one's blocks. Under async scheduling loads are asynchronous in both modes."""
    warm = h.engine()
    shared = prompts(13, 200, [0])[0][:192]
    warm.add("warm", [*shared, 5, 5, 5], 3)
    warm.run()
    h.check(warm)
    eng = h.engine(max_batched=1024, async_scheduling=async_scheduling)
    for i in range(4):
        eng.add(f"s{i}", [*shared, *range(400 + 10 * i, 410 + 10 * i)], 4)
    eng.run()
    h.check(eng)
    h.facts.update(loaded_tokens=eng.tally().get("load_tokens", 0))
    assert h.facts["loaded_tokens"] == 192, h.facts


def daemon_killed(h: Harness) -> None:
    """SIGKILL of the daemon mid-run, while requests still have chunks to store and new ones
    arrive to be looked up: each client waits out at most one timeout, then fails fast (no
    store, lookup or report is sent to the dead daemon once its breaker opened; the worker's
    pipelined client may have a few calls in flight during that first timeout, each failed by
    its own deadline); every request still finishes with the right tokens. A daemon started
    again in the same place is used again once the breaker's probe gets an answer."""
    warm = h.engine(timeout_s=1.0)
    warm.add("warm", prompts(8, 150, [0])[0], 3)
    warm.run()
    h.check(warm)
    eng = h.engine(timeout_s=1.0)
    sends: dict[str, int] = {"scheduler": 0, "worker": 0}
    after_open: dict[str, int] = {"scheduler": 0, "worker": 0}  # sent with the breaker open
    tripped: dict[str, int] = {}  # each client's breaker trips when the daemon died
    roles = (("scheduler", eng.sched_connector.client), ("worker", eng.worker.client))
    for role, client in roles:
        count_sends(client, sends, role)

        def opened(body: Any, send: Any, role: str = role, client: Any = client) -> Any:
            if role in tripped and client.breaker.trips > tripped[role]:
                after_open[role] += 1
            return send(body)

        client.session.intercept(opened)
    late = prompts(8, 150, [40, 60])

    def kill(step: int, out: Any) -> None:
        if step == 3:
            h.daemon.kill()
            sends.update(scheduler=0, worker=0)
            tripped.update({role: client.breaker.trips for role, client in roles})
            for i, p in enumerate(late):  # looked up while the daemon is dead: a miss
                eng.add(f"late{i}", p, 20)

    eng.between_schedule_and_load = kill
    for i, p in enumerate(prompts(8, 150, [35, 5])):  # 185 + 30: a chunk completes at 192
        eng.add(f"k{i}", p, 30)
    eng.run()
    check_outputs(eng)  # the reader cannot ask a dead daemon
    h.facts["sends_after_kill"] = dict(sends)
    assert sends["scheduler"] <= 2 and sends["worker"] <= eng.worker.client.session.window, sends
    assert after_open == {"scheduler": 0, "worker": 0}, f"sent to a dead daemon, breaker open: {after_open}"
    assert eng.tally().get("store_failures", 0) + eng.tally().get("lookup_failures", 0) >= 2
    # One more request while the daemon is still dead: its lookup meets the open breaker
    # (refused, never sent) however few steps ran after the kill on a loaded machine, so this
    # check cannot pass without a breaker (control ``no_breaker``), where the counts above may.
    eng.add("dead", prompts(8, 150, [70])[0], 3)
    eng.run()
    check_outputs(eng)
    assert after_open == {"scheduler": 0, "worker": 0}, f"sent to a dead daemon, breaker open: {after_open}"
    assert eng.sched_connector.client.breaker.short_circuited > 0, "no call met the open breaker"
    h.daemon.proc = h.daemon.start()
    for client in (eng.sched_connector.client, eng.worker.client):
        wait_closed(client)
    eng.add("after", prompts(8, 150, [90])[0], 3)
    eng.run()
    tokens = list(eng.requests["after"].prompt_token_ids or []) + eng.outputs("after")
    assert h.reader.served("", tokens, "") == stored_tokens(len(tokens)), "nothing stored after the restart"


def stalled(h: Harness, what: str) -> None:
    """The daemon (SIGSTOP), or the Redis L2 it loads a chunk from, stops during a load: the
    worker gives up after its timeout and vLLM recomputes. The request is then aborted and
    its blocks go to another request, which computes its prompt in them; only then does the
    stopped process run again. The load is past its deadline and must move no byte: written
    late, it would overwrite the other request's KV (its next steps would read a wrong
    context). Redis: the daemon waits for L2 no longer than the client's deadline. Its reads
    are held at a proxy (``RedisReadGate``) rather than the server stopped: the lookup's
    ``EXISTS`` passes, and the L2 -> L1 prefetch it starts stalls every time."""
    if what == "redis":
        if shutil.which("redis-server") is None:
            raise ScenarioSkipped("redis-server is not installed")
        redis = LocalRedis().start()
        h.cleanups.append(redis.close)
        gate = RedisReadGate(redis)
        h.cleanups.append(gate.close)
        h.replace_daemon(["--l2-redis-url", gate.url, "--l2-redis-trust-all", "--l2-redis-timeout", "30"])
        assert _stall_once(h, what, gate.hold, gate.release), "the stalled load did not fail"
        return
    pids: list[int] = []

    def stop() -> None:
        pids.append(h.daemon.proc.pid)
        os.kill(pids[0], signal.SIGSTOP)

    assert _stall_once(h, what, stop, lambda: pids and os.kill(pids[0], signal.SIGCONT)), (
        "the stalled load did not fail"
    )


def _stall_once(h: Harness, what: str, halt: Callable[[], None], resume: Callable[[], object]) -> bool:
    """``stalled``; True if the load did wait for the stopped process (``halt``: at the
    step that plans the load for the daemon, before the request arrives for Redis)."""
    prefix = prompts(10, 256, [0])[0]
    warm = h.engine()
    warm.add("warm", [*prefix, 3], 2)
    warm.run()
    h.check(warm)
    if what == "redis":
        h.daemon.restart(graceful=True)  # L1 empty: the prefix comes from Redis
        halt()  # its reads wait at the gate; the lookup's EXISTS passes
    eng = h.engine(timeout_s=1.0, num_blocks=26)
    a, b = "a", "b"
    state: dict[str, int] = {}
    targets: set[int] = set()  # the blocks the stalled load would write

    def stop(step: int, out: Any) -> None:
        if "stopped" not in state and out.kv_connector_metadata.plan.retrieves:
            if what != "redis":
                halt()
            state["stopped"] = step
            targets.update(out.kv_connector_metadata.plan.retrieves[0].block_ids)

    def reuse_then_resume(step: int) -> None:
        if "stopped" in state and a not in eng.aborted:
            eng.abort(a)  # its blocks go back to vLLM's pool
            eng.add(b, prompts(20, 700, [0])[0], 4)  # 22 of the 25 blocks: a's too
        elif "resumed" not in state and b in eng.requests and eng.requests[b].num_computed_tokens >= 600:
            resume()
            state["resumed"] = step
            (held,) = eng.scheduler.kv_cache_manager.get_block_ids(b)
            state["reused_blocks"] = len(targets & set(held))
            if what == "redis":  # the daemon's L2 wait ends now: let it finish before b reads on
                wait_for_log(h.daemon, f"retrieve session={a} ")

    eng.between_schedule_and_load = stop
    eng.before_schedule = reuse_then_resume
    eng.add(a, [*prefix, 5, 6], 50)
    try:
        eng.run()
    finally:
        resume()
    h.facts.update(state)
    assert "resumed" in state and state["reused_blocks"] >= 4, state
    for client in (eng.sched_connector.client, eng.worker.client):
        wait_closed(client)
    h.check(eng, all_stored=False)
    return eng.tally().get("load_failures", 0) >= 1


def store_release(h: Harness, async_stores: bool, abort: bool = False) -> None:
    """Blocks are freed only after the daemon copied them. ``g`` (15 blocks) finishes; then
    ``h`` arrives needing 26 blocks, more than are free while ``g`` holds its own (27 usable),
    so vLLM can run ``h`` only in ``g``'s blocks. Async stores: every store of ``g`` is held
    back before it reaches the daemon (a gate in its client) until ``h`` has waited three
    steps; ``g`` must be reported sent only after the gate opens, and ``h`` scheduled only
    after that. Freed early, ``h``'s prefill would overwrite ``g``'s blocks before the store
    copies them, and the daemon would serve ``h``'s bytes under ``g``'s tokens (the reader's
    byte check). Sync stores: each store is done in the step that issued it, and nothing
    holds ``g``'s blocks after it finishes. ``abort``: ``g`` is aborted (a client disconnect)
    after five output tokens, with its first store still held: the same must hold."""
    eng = h.engine(num_blocks=28, max_batched=1024, async_stores=async_stores)
    client = eng.worker.client
    gate = threading.Event()
    if not async_stores:
        gate.set()
    calls: list[tuple[int, int]] = []  # (step issued, step returned) of g's stores, sync mode
    state: dict[str, int] = {}

    def gated(body: Any, send: Any) -> Any:  # the worker client's path to the daemon
        if isinstance(body, m.Store) and body.request_id == "g":
            gate.wait(60)
            state["gate_passed"] = state.get("gate_passed", 0) + 1
        return send(body)

    client.session.intercept(gated)
    store_async, store = client.store_async, client.store

    def counted_async(*args: Any, **kw: Any) -> Any:
        if kw.get("request_id") == "g":
            state["last_issued"] = len(eng.steps)
        return store_async(*args, **kw)

    def counted(*args: Any, **kw: Any) -> Any:
        issued = len(eng.steps)
        result = store(*args, **kw)
        if kw.get("request_id") == "g":
            state["last_issued"] = issued
            calls.append((issued, len(eng.steps)))
        return result

    client.store_async, client.store = counted_async, counted  # type: ignore[method-assign]
    g_blocks: set[int] = set()

    def arrive_then_open(step: int) -> None:
        g = eng.requests["g"]
        if abort and "aborted" not in state and "last_issued" in state and len(g.output_token_ids) >= 5:
            eng.abort("g")
            state["aborted"] = step
        if g.is_finished() and "h" not in eng.requests:
            state["g_finished"] = step
            g_blocks.update(eng.steps[-1].blocks.get("g", []))
            eng.add("h", prompts(31, 810, [0])[0], 4)
        elif "h" in eng.requests and not gate.is_set() and step >= state["g_finished"] + 3:
            assert eng.requests["h"].num_computed_tokens == 0, "h ran while g's stores were held"
            (held,) = eng.scheduler.kv_cache_manager.get_block_ids("g")
            assert g_blocks <= set(held), "g's blocks were freed while its stores were held"
            state["gate_opened"] = step
            gate.set()

    def first_run_of_h(step: int, out: Any) -> None:
        if "h" in out.num_scheduled_tokens and "h_first" not in state:
            state["h_first"] = step
            (held,) = eng.scheduler.kv_cache_manager.get_block_ids("h")
            state["g_blocks_reused"] = len(g_blocks & set(held))

    eng.before_schedule = arrive_then_open
    eng.between_schedule_and_load = first_run_of_h
    eng.add("g", prompts(30, 400, [0])[0], 60)  # chunks stored in its first and 48th step
    try:
        eng.run()
    finally:
        gate.set()
    reported = [s.step for s in eng.steps if "g" in s.sending]
    state["reported"] = reported[0] if reported else -1
    h.facts.update(state)
    assert state.get("g_blocks_reused", 0) >= 10, f"h did not reuse g's blocks: {state}"
    if async_stores:
        assert state.get("gate_passed", 0) >= (1 if abort else 2) and "gate_opened" in state, state
        # Issued before the gate opened, reported after: the store outlived its step, and
        # vLLM freed the blocks (h ran in them) only after the report.
        assert state["last_issued"] < state["gate_opened"] <= state["reported"] < state["h_first"], state
    else:
        assert calls and all(issued == done for issued, done in calls), calls
        assert state["last_issued"] <= state["g_finished"] <= state["h_first"], state
    h.check(eng)


SCENARIOS: dict[str, Callable[[Harness], None]] = {
    "shared_prefixes_sync": lambda h: shared_prefixes(h, False),
    "shared_prefixes_async": lambda h: shared_prefixes(h, True),
    "failed_load_sync": lambda h: failed_load(h, False),
    "failed_load_async": lambda h: failed_load(h, True),
    "lora": lora,
    "multimodal": multimodal,
    "prompt_embeds": prompt_embeds,
    "preemption": preemption,
    "batched_lookups": batched_lookups,
    "shared_load": lambda h: shared_load(h, False),
    "shared_load_async": lambda h: shared_load(h, True),
    "daemon_killed": daemon_killed,
    "stalled_daemon": lambda h: stalled(h, "daemon"),
    "stalled_redis_l2": lambda h: stalled(h, "redis"),
    "store_release_async": lambda h: store_release(h, True),
    "store_release_sync": lambda h: store_release(h, False),
    "store_release_abort_async": lambda h: store_release(h, True, abort=True),
    **LOAD_SCENARIOS,
    **FAILURE_SCENARIOS,
    **EDGE_SCENARIOS,
    **DECODE_SCENARIOS,
}
SYNC_LOADS = [
    name
    for name in SCENARIOS
    if (name not in LOAD_SCENARIOS or name == "preempted_store")
    and name not in ONCE
    and name not in EDGES_NEED_ASYNC_LOADS
]
"""What a run with ``async_loads: false`` runs: the rest need loads that outlive their step, or
do not use the connector at all (``sched_failures.ONCE``)."""


MODES = {"async_loads": True, "sync_loads": False}
"""The connector's ``async_loads`` setting of each run mode."""


def run_mode(mode: str, only: list[str] | None, workdir: Path, spawn: Spawn | None, out: Path,
             results: dict[str, Any]) -> None:  # fmt: skip
    """Every scenario of ``mode`` (or ``only``), each result written to ``out`` as it ends."""
    runs = results.setdefault(mode, {})
    for name in only or (list(SCENARIOS) if MODES[mode] else SYNC_LOADS):
        t0 = time.perf_counter()
        facts: Facts = {}
        try:
            with harness(name, workdir, spawn, async_loads=MODES[mode]) as h:
                facts = h.facts
                SCENARIOS[name](h)
                h.check_all_done()
            runs[name] = {"ok": True, "error": "", "facts": facts}
        except ScenarioSkipped as exc:
            runs[name] = {"ok": True, "error": "", "facts": facts, "skipped": str(exc)}
        except Exception:
            runs[name] = {"ok": False, "error": traceback.format_exc()[-4000:], "facts": facts}
        runs[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(mode, name, "ok" if runs[name]["ok"] else "FAILED", runs[name]["seconds"], flush=True)
        out.write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON: {mode: {scenario: result}}")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["async_loads"],
                   help="one process runs them in turn (vLLM's import is paid once)")  # fmt: skip
    p.add_argument("--exec-daemons", action="store_true", help="exec each daemon, not fork a zygote")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvc-sched-")))
        spawn = None if args.exec_daemons else stack.enter_context(Zygote()).spawn
        write_model_config(str(workdir / "model"))
        for mode in args.modes:
            run_mode(mode, args.only, workdir, spawn, Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
