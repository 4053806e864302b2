"""Scheduler-harness scenario of a decode's per-step cost (vLLM venv only; issue 42 §1).

On most decode steps a request neither gets a new block nor completes a chunk, so the
scheduler half has nothing to report or store for it and must not ask vLLM for its block
table (``KVCacheManager.get_block_ids`` builds the whole list, for every request, every
step). This scenario counts those reads under vLLM's real scheduler and checks they happen
exactly in the steps that need them, while every chunk is still stored (``Harness.check``).
Registered in ``sched_scenarios.SCENARIOS``; its control (every table read on every step) is
``sched_controls``' ``tables_every_step``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

from typing import Any

from kvcache.integrations.vllm.connector import KVCacheMetadata
from tests.integrations.vllm.sched_world import Harness, prompts


def block_tables_at_boundaries(h: Harness, async_scheduling: bool) -> None:
    """Two requests (40 and 70 prompt tokens) each decode 100 tokens: 64-token chunks, 32-token
    blocks. The scheduler half reads a request's block table (from ``build_connector_meta``) in
    a step if and only if that step is the request's first, gives it new blocks, or plans a
    store of it; far fewer reads than steps. Table growth is read from the blocks the worker
    was handed (the fake forward's tables), stores from the plan the workers got."""
    eng = h.engine(async_scheduling=async_scheduling)
    manager, connector = eng.scheduler.kv_cache_manager, eng.sched_connector
    get_block_ids, build = manager.get_block_ids, connector.build_connector_meta
    reads: set[tuple[int, str]] = set()
    planning: list[bool] = []

    def counted(req_id: str) -> Any:
        if planning:
            reads.add((len(eng.steps), req_id))
        return get_block_ids(req_id)

    def building(out: Any) -> Any:
        planning.append(True)
        try:
            return build(out)
        finally:
            planning.clear()

    stored: set[tuple[int, str]] = set()

    def record_stores(step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVCacheMetadata)
        stored.update((step, s.req_id) for s in meta.plan.stores if s.token_ids and not s.final)

    manager.get_block_ids = counted  # type: ignore[method-assign]
    connector.build_connector_meta = building  # type: ignore[method-assign]
    eng.between_schedule_and_load = record_stores
    for req_id, prompt in zip(("a", "b"), prompts(120, 0, [40, 70]), strict=True):
        eng.add(req_id, prompt, 100)
    eng.run()
    h.check(eng)
    needed: set[tuple[int, str]] = set(stored)
    held: dict[str, int] = {}
    for log in eng.steps:
        for req_id, blocks in log.blocks.items():
            if len(blocks) != held.get(req_id):  # its first step, or new blocks
                needed.add((log.step, req_id))
            held[req_id] = len(blocks)
    scheduled = sum(len(log.blocks) for log in eng.steps)
    h.facts.update(table_reads=len(reads), needed=len(needed), scheduled=scheduled, stores=len(stored))
    assert stored, "no store was planned: the scenario proves nothing"
    assert reads == needed, (
        f"tables read in steps that needed none: {sorted(reads - needed)[:8]}; "
        f"not read where needed: {sorted(needed - reads)[:8]}"
    )
    assert len(reads) * 4 < scheduled, h.facts


SCENARIOS = {
    "block_tables_at_boundaries": lambda h: block_tables_at_boundaries(h, False),
    "block_tables_at_boundaries_async": lambda h: block_tables_at_boundaries(h, True),
}
