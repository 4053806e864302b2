"""An MLA model at tensor parallelism 2 under vLLM's scheduler (runs in the vLLM venv only).

MLA's latent cache is computed from replicated weights, so every tensor-parallel rank holds
the same bytes; vLLM 0.32 says so in ``KVCacheConfig.kv_tp_replicas``. The engines are
``sched_tp_engine.TPEngine``: vLLM's real scheduler, one worker connector per rank, each rank
checking every byte of the context it reads, outputs merged by vLLM's ``KVOutputAggregator``.

What it proves (``SCENARIOS``): a chunk is stored once for both ranks (the daemon's L1 holds
each distinct chunk once, the second rank issues no store), both ranks load every chunk a
later engine hits and read the oracle's bytes, an engine at TP=1 on the same model misses
(another TP size never reads it), a writer whose stores fail leaves both ranks a miss, and a
rank whose key scope differs from the writer's (another model's bytes) is never served the
writer's chunk: its load fails, vLLM recomputes, the tokens stay the oracle's. The controls
(``CONTROLS``) show the checks can fail: every rank storing, and per-rank key scopes (the
connector before it read ``kv_tp_replicas``). Not collected by pytest: ``test_sched_mla.py``
runs it. ``python sched_mla.py --out result.json [--controls] [--only NAME ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvcache.integrations.vllm import connector as connector_mod
from kvcache.integrations.vllm.worker_side import WorkerSide
from kvcache.protocol import messages as m
from tests.integrations.vllm.sched_engine import vllm_config, write_model_config
from tests.integrations.vllm.sched_invariants import RUN_BOUND_S
from tests.integrations.vllm.sched_tp_engine import TPEngine
from tests.integrations.vllm.sched_world import CHUNK, Harness, Reader, check_outputs, prompts, stored_tokens

TP = 2

# ------------------------------------------------------------------------------- the world


class World(Harness):
    """``Harness`` whose engines are ``TPEngine``s, with a reader in the shard's key scope."""

    def __init__(self, name: str, workdir: Path) -> None:
        super().__init__(name, workdir, None)
        self.scoped = f"{self.model}@tp0of1x{TP}"  # one shard of TP replicas (``config.TPGroup``)
        self._reader = Reader(self.daemon.endpoint, self.scoped)

    def tp_engine(
        self,
        tp: int = TP,
        *,
        async_scheduling: bool = False,
        rank_extra: dict[int, dict[str, Any]] | None = None,
    ) -> TPEngine:
        extra = {"endpoint": self.daemon.endpoint, "model_name": self.model, "sync_lone_loads": False}
        config = vllm_config(str(self.workdir / "model"), extra, async_scheduling=async_scheduling)
        eng = TPEngine(config, 128, tp, rank_extra)
        self.engines.append(eng)
        return eng

    def l1_chunks(self) -> int:
        status = self.reader.client.status()
        return int(status["engine"]["l1"]["num_chunks"])

    def scopes(self) -> dict[int, str]:
        """Every instance the daemon holds, and the key scope (model name) it registered."""
        return {i["instance_id"]: i["model_name"] for i in self.reader.client.status()["engine"]["instances"]}


def distinct_chunks(token_lists: list[list[int]]) -> int:
    """How many distinct chunks (prefixes ending on a chunk boundary) the lists' KV makes."""
    return len(
        {tuple(t[: (k + 1) * CHUNK]) for t in token_lists for k in range(stored_tokens(len(t)) // CHUNK)}
    )


def run_all(eng: TPEngine, reqs: list[tuple[str, list[int]]], max_tokens: int) -> list[list[int]]:
    for req_id, prompt in reqs:
        eng.add(req_id, prompt, max_tokens)
    eng.run(within_s=len(eng.ranks) * RUN_BOUND_S)  # each step runs every rank's forward and copies
    for rank in eng.ranks:
        assert rank.worker.wait_for_stores(10), "stores still in flight"
    return [list(eng.requests[r].prompt_token_ids or []) + eng.outputs(r) for r, _ in reqs]


# ------------------------------------------------------------------------------- scenarios


def stored_once(w: World, async_scheduling: bool = False) -> dict[str, Any]:
    """Engine A (TP=2) computes prompts with shared prefixes: the daemon's L1 holds each
    distinct chunk once, rank 1 issues no store, and a third engine reads every chunk
    byte-exact. Engine B (TP=2, fresh) runs them again: the scheduler plans loads, both ranks
    load the same bytes (each rank's forward checks every context byte against the oracle),
    and computes only the tails. An engine at TP=1 on the same model then misses."""
    reqs = [(f"r{i}", p) for i, p in enumerate(prompts(5, 200, [10, 70, 135, 3]))]
    a = w.tp_engine(async_scheduling=async_scheduling)
    seqs = run_all(a, reqs, 6)
    want = distinct_chunks(seqs)
    held = w.l1_chunks()
    assert held == want, f"the daemon's L1 holds {held} chunks for {want} distinct ones (TP={TP})"
    w.check(a)  # the reader, in the shard's scope, is served every chunk byte-exact
    rank_stores = [a.rank_total(r, "store_jobs_issued") for r in range(TP)]
    assert rank_stores[0] > 0 and not any(rank_stores[1:]), f"store jobs per rank: {rank_stores}"
    scopes = set(w.scopes().values())
    assert scopes == {w.scoped}, f"the ranks registered the key scopes {scopes}"

    b = w.tp_engine(async_scheduling=async_scheduling)
    run_all(b, [(f"b{r}", p) for r, p in reqs], 6)
    check_outputs(b)
    planned = sum(b.planned_loads.values())
    loaded = [b.rank_total(r, "load_tokens") for r in range(TP)]
    loaded_bytes = [b.rank_total(r, "load_bytes") for r in range(TP)]
    assert planned > 0 and loaded == [planned] * TP, f"planned {planned} tokens, ranks loaded {loaded}"
    assert loaded_bytes[0] > 0 and len(set(loaded_bytes)) == 1, f"bytes loaded per rank: {loaded_bytes}"
    assert not b.wrong_reads(), "a rank read a context that differs from the oracle's"
    assert not any(b.rank_total(r, "load_failures") for r in range(TP))
    after_b = w.l1_chunks()

    single = w.tp_engine(1, async_scheduling=async_scheduling)
    run_all(single, [(f"s{r}", p) for r, p in reqs], 2)
    check_outputs(single)
    assert not single.planned_loads, f"an engine at TP=1 loaded {single.planned_loads} (another TP size)"
    return {"chunks": want, "l1_chunks": held, "after_b": after_b, "store_jobs": rank_stores,
            "loaded_tokens": loaded, "loaded_bytes": loaded_bytes}  # fmt: skip


def writer_fails(w: World) -> dict[str, Any]:
    """The writer's stores fail (its daemon calls refused): nothing is stored, and a later
    engine's ranks both miss (no load planned) and compute the oracle's tokens."""
    reqs = [(f"r{i}", p) for i, p in enumerate(prompts(6, 150, [20, 90]))]
    a = w.tp_engine()
    client = a.ranks[0].worker.client

    def refused(*args: Any, **kw: Any) -> Future[m.StoreResult]:
        failed: Future[m.StoreResult] = Future()
        failed.set_exception(ConnectionError("injected: the writer's store failed"))
        return failed

    client.store_async = refused  # type: ignore[method-assign]
    run_all(a, reqs, 4)
    check_outputs(a)
    assert w.l1_chunks() == 0, f"the daemon holds {w.l1_chunks()} chunks though the writer stored none"
    assert a.rank_total(0, "store_failures") > 0 and not a.rank_total(1, "store_jobs_issued")
    b = w.tp_engine()
    run_all(b, [(f"b{r}", p) for r, p in reqs], 4)
    check_outputs(b)
    assert not b.planned_loads and not any(b.rank_total(r, "load_tokens") for r in range(TP))
    return {"store_failures": a.rank_total(0, "store_failures")}


def other_scope_rank(w: World) -> dict[str, Any]:
    """Engine B's rank 1 keys chunks in another scope (another model's bytes): the scheduler
    (rank 0's scope) finds A's chunks and plans loads, rank 0 loads them, rank 1 is served
    nothing (a miss: its load fails), vLLM recomputes those blocks on every rank, and the
    tokens are the oracle's."""
    reqs = [(f"r{i}", p) for i, p in enumerate(prompts(7, 150, [20, 90]))]
    run_all(w.tp_engine(), reqs, 4)
    b = w.tp_engine(rank_extra={1: {"model_name": "another-model"}})
    run_all(b, [(f"b{r}", p) for r, p in reqs], 4)
    check_outputs(b)
    assert b.planned_loads, "the scheduler planned no load"
    assert not b.rank_total(1, "load_tokens"), "rank 1 was served chunks of another key scope"
    assert b.rank_total(1, "load_failures") > 0 and any(s.invalid_block_ids for s in b.steps)
    return {"planned": sum(b.planned_loads.values()), "rank0_loaded": b.rank_total(0, "load_tokens")}


SCENARIOS: dict[str, Callable[[World], dict[str, Any]]] = {
    "stored_once": stored_once,
    "stored_once_async_scheduling": lambda w: stored_once(w, async_scheduling=True),
    "writer_fails": writer_fails,
    "other_scope_rank": other_scope_rank,
}


# --------------------------------------------------------------------------------- controls


@contextlib.contextmanager
def every_rank_stores() -> Iterator[None]:
    """Every rank stores (no writer chosen): the daemon dedupes the bytes, but rank 1 copies
    each chunk again."""
    old = WorkerSide.__init__

    def writing(self: WorkerSide, *args: Any, **kw: Any) -> None:
        old(self, *args, **{**kw, "writes": True})

    WorkerSide.__init__ = writing  # type: ignore[method-assign]
    try:
        yield
    finally:
        WorkerSide.__init__ = old  # type: ignore[method-assign]


@contextlib.contextmanager
def per_rank_scopes() -> Iterator[None]:
    """The connector before it read ``kv_tp_replicas``: each rank its own key scope."""
    old = connector_mod.TPGroup

    def unreplicated(rank: int = 0, world_size: int = 1, replicas: int = 1) -> Any:
        return old(rank, world_size, 1)

    connector_mod.TPGroup = unreplicated  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        connector_mod.TPGroup = old  # type: ignore[misc]


CONTROLS = {
    # (the safeguard switched off, the check that must catch it)
    "every_rank_stores": (every_rank_stores, "store jobs per rank"),
    "per_rank_scopes": (per_rank_scopes, "the daemon's L1 holds"),
}


def _run(name: str, workdir: Path) -> dict[str, Any]:
    world = World(name, workdir)
    try:
        return {"ok": True, "facts": SCENARIOS[name](world)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    finally:
        world.close()
        world.daemon.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--controls", action="store_true", help="also run every control (each must fail)")
    parser.add_argument("--only", nargs="*", help="these scenarios and controls only")
    args = parser.parse_args(argv)
    wanted = set(args.only or [*SCENARIOS, *CONTROLS])
    results: dict[str, Any] = {"scenarios": {}, "controls": {}}
    with tempfile.TemporaryDirectory(prefix="kvc-mla-") as tmp:
        workdir = Path(tmp)
        write_model_config(str(workdir / "model"))
        for name in [n for n in SCENARIOS if n in wanted]:
            results["scenarios"][name] = _run(name, workdir)
            print(name, "ok" if results["scenarios"][name]["ok"] else "FAILED", flush=True)
        if args.controls:
            for control, (make, caught_by) in CONTROLS.items():
                if control not in wanted:
                    continue
                with make():
                    result = _run("stored_once", workdir)
                result["caught"] = not result["ok"] and caught_by in result["error"]
                results["controls"][control] = result
                print(control, "failed as it must" if result["caught"] else "NOT CAUGHT", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
