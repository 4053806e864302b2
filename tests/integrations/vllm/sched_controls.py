"""Negative controls for the scheduler harness: each fix switched off, its scenarios must fail.

Run in the vLLM venv, by ``test_sched_controls.py`` in the suite (and so in CI), or by hand::

    .vllm-venv/bin/python tests/integrations/vllm/sched_controls.py [--out FILE] [NAME ...]

Each control patches one safeguard out of the connector or the client, runs the scenarios
that guard it (``sched_scenarios.SCENARIOS``; a name ending in ``/sync_loads`` runs with the
connector's ``async_loads: false``) and reports whether they failed; the exit status is 1 if
any scenario still passed (it would not prove its safeguard). ``--out`` writes each verdict
as JSON (``{"control / scenario": {"verdict": "failed" | "passed" | "skipped", "detail": ...}}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvcache.client.session import Session
from kvcache.integrations.vllm import connector as connector_mod
from kvcache.integrations.vllm import scheduler_side
from kvcache.integrations.vllm.dropped_loads import DroppedLoads
from kvcache.integrations.vllm.plan import Planner
from kvcache.integrations.vllm.retrieve_timing import RetrieveTiming
from kvcache.integrations.vllm.shared_loads import SharedLoads
from kvcache.integrations.vllm.worker import ConnectorWorker
from kvcache.protocol.breaker import CircuitBreaker
from kvcache.testing.daemon_zygote import Zygote
from tests.integrations.vllm import sched_world
from tests.integrations.vllm.sched_engine import write_model_config
from tests.integrations.vllm.sched_scenarios import SCENARIOS
from tests.integrations.vllm.sched_world import ScenarioSkipped, harness


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _tokens_only(request: Any) -> str | None:
    """Keys from tokens and salt alone (prompt embeddings still refused)."""
    return None if getattr(request, "prompt_embeds", None) is not None else ""


@contextmanager
def no_key_extra() -> Iterator[None]:
    with (
        patched(scheduler_side, "request_key_extra", _tokens_only),
        patched(sched_world, "request_key_extra", _tokens_only),
    ):
        yield


@contextmanager
def embeds_keyed_by_tokens() -> Iterator[None]:
    with (
        patched(scheduler_side, "request_key_extra", lambda r: ""),
        patched(sched_world, "request_key_extra", lambda r: ""),
    ):
        yield


@contextmanager
def no_store_cut() -> Iterator[None]:
    store = ConnectorWorker.store

    def uncut(self: ConnectorWorker, plan: Any) -> None:
        unfilled, self._unfilled = self._unfilled, {}
        try:
            store(self, plan)
            # Waited for: an asynchronous store may copy only after vLLM recomputed the
            # blocks in place, storing the right bytes by luck.
            self.wait_stores(None)
        finally:
            self._unfilled = unfilled

    with patched(ConnectorWorker, "store", uncut):
        yield


@contextmanager
def no_lookup_cache() -> Iterator[None]:
    cls = scheduler_side.SchedulerSide
    lookup = cls.get_num_new_matched_tokens

    def every_step(self: Any, request: Any, num_computed_tokens: int) -> Any:
        self._lookups._last.clear()
        return lookup(self, request, num_computed_tokens)

    with patched(cls, "get_num_new_matched_tokens", every_step):
        yield


@contextmanager
def sync_loads_under_async() -> Iterator[None]:
    cls = scheduler_side.SchedulerSide
    init = cls.__init__

    def sync_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._async_retrieves = False
        # The timing took its own copy of the setting at construction.
        self._timing = RetrieveTiming(False, False)

    with patched(cls, "__init__", sync_init):
        yield


@contextmanager
def loads_reported_when_issued() -> Iterator[None]:
    """Asynchronous loads reported received in the step that issued them, copied or not (as
    before ``async_loads``): vLLM lets the request go, or frees an aborted one's blocks."""
    load = ConnectorWorker.retrieve

    def report_at_once(self: ConnectorWorker, plan: Any) -> None:
        load(self, plan)
        self._finished_recving |= {s.req_id for s in plan.retrieves if s.is_async}

    def settle_unreported(self: ConnectorWorker) -> None:
        settled, _ = self._retrieves.settled()
        for done in settled:
            self._retrieved(done, self._step, False)

    with (
        patched(ConnectorWorker, "retrieve", report_at_once),
        patched(ConnectorWorker, "_settle_retrieves", settle_unreported),
    ):
        yield


@contextmanager
def loading_released_too() -> Iterator[None]:
    """``request_finished`` blind to unreported loads: a request with earlier stores is held
    for them even while vLLM holds it for its load."""
    cls = scheduler_side.SchedulerSide
    finished = cls.request_finished

    def unguarded(self: Any, request: Any, block_ids: list[int]) -> Any:
        loading, self._loading = self._loading, set()
        try:
            return finished(self, request, block_ids)
        finally:
            self._loading = loading

    with patched(cls, "request_finished", unguarded):
        yield


def _release_at_once(self: ConnectorWorker) -> set[str]:
    """Finished requests reported sent as soon as their release arrives, stores in flight or not."""
    self._finished_sending |= self._releasing
    self._releasing = set()
    done, self._finished_sending = self._finished_sending, set()
    return done


@contextmanager
def no_dropped_load_marks() -> Iterator[None]:
    with (
        patched(ConnectorWorker, "take_failed_async", lambda self: frozenset()),
        patched(DroppedLoads, "note_dropped", lambda self, r: None),
    ):
        yield


CONTROLS: dict[str, tuple[Callable[[], Any], list[str]]] = {
    "no_key_extra": (no_key_extra, ["lora", "multimodal"]),
    "embeds_keyed_by_tokens": (embeds_keyed_by_tokens, ["prompt_embeds"]),
    "no_store_cut": (no_store_cut, ["failed_load_sync/sync_loads"]),
    "no_final_store": (
        lambda: patched(Planner, "final_store", lambda self, *a: False),
        ["shared_prefixes_async"],
    ),
    "sync_loads_under_async": (sync_loads_under_async, ["failed_load_async"]),
    "no_report_restart": (lambda: patched(Planner, "preempted", lambda self, r: None), ["preemption"]),
    "no_lookup_cache": (no_lookup_cache, ["preemption"]),
    # Requests sharing a prefix another one is loading each copy it again.
    "no_shared_loads": (
        lambda: patched(SharedLoads, "behind", lambda self, *a: None),
        ["shared_load", "shared_load_async", "shared_load_async/sync_loads"],
    ),
    "no_breaker": (lambda: patched(CircuitBreaker, "refuse", lambda self: False), ["daemon_killed"]),
    "no_deadline": (
        lambda: patched(Session, "_stamped", Session._with_token),
        ["stalled_daemon", "stalled_redis_l2"],
    ),
    # Blocks released with their stores in flight: vLLM hands them to the next request.
    "no_store_hold": (
        lambda: patched(ConnectorWorker, "take_finished_sending", _release_at_once),
        ["store_release_async"],
    ),
    # An aborted request's blocks freed while its load may still copy into them.
    "no_load_hold": (
        loads_reported_when_issued,
        ["abort_while_loading_sync", "abort_while_loading_async", "late_loads_sync"],
    ),
    # A request aborted while loading held by vLLM and by the connector: reported twice.
    "no_loading_guard": (loading_released_too, ["abort_resumed_while_loading"]),
    # Issue 26: a request whose asynchronous load failed outright offered a load again at its
    # next admission; vLLM 0.32 reserves its own blocks against it, and it waits forever.
    # (Two signals mark it: the workers' report of the failure, and vLLM asking again about a
    # request admitted with an asynchronous load that never ran; either alone suffices.)
    "no_failed_load_recompute": (
        no_dropped_load_marks,
        [
            "slow_l2",
            "daemon_lost_while_loading",
            "partial_batch_failure",
            "preempted_resume_fails",
            "shared_blocks_of_a_failed_load",
        ],
    ),
    # A request whose own load succeeded, truncated by vLLM for a block it shares with
    # another request's failed load: only vLLM asking again tells; the workers report nothing.
    "no_reask_mark": (
        lambda: patched(DroppedLoads, "note_dropped", lambda self, r: None),
        ["shared_blocks_of_a_failed_load"],
    ),
    # Issue 42: every scheduled request's block table read on every step (the plan's cost
    # on a decode step), not only in the steps that report a new block or store a chunk.
    "tables_every_step": (
        lambda: patched(scheduler_side, "blocks_changed", lambda out: None),
        ["block_tables_at_boundaries", "block_tables_at_boundaries_async"],
    ),
    # A preempted request's stores waited for only in start_load_kv, after the forward.
    "no_preemption_hook": (
        lambda: patched(connector_mod.KVCacheConnector, "handle_preemptions", lambda self, meta: None),
        ["preempted_store"],
    ),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write every verdict as JSON")
    parser.add_argument("names", nargs="*", metavar="NAME", help="controls to run (default: all)")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - set(CONTROLS)):
        parser.error(f"unknown controls {unknown}; known: {sorted(CONTROLS)}")
    verdicts: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvc-sched-controls-") as tmp, Zygote() as zygote:
        workdir = Path(tmp)
        write_model_config(str(workdir / "model"))
        for name in args.names or list(CONTROLS):
            make, scenarios = CONTROLS[name]
            for spec in scenarios:
                scenario, _, mode = spec.partition("/")
                with make():
                    try:
                        with harness(scenario, workdir, zygote.spawn, async_loads=mode != "sync_loads") as h:
                            SCENARIOS[scenario](h)
                        verdict, detail = "passed", "proves nothing"
                    except ScenarioSkipped as exc:
                        verdict, detail = "skipped", str(exc)
                    except Exception as exc:
                        last = str(exc).strip().splitlines()
                        verdict, detail = "failed", f"{type(exc).__name__}: {last[0] if last else ''}"[:200]
                verdicts[f"{name} / {spec}"] = {"verdict": verdict, "detail": detail}
                print(f"{name} / {spec}: {verdict}: {detail}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(verdicts, indent=1))
    return 1 if any(v["verdict"] == "passed" for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
