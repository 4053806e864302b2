"""The scheduler-side rules of the vLLM connector, on plain values (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvcache.integrations.vllm.plan import Admission, Planner, block_hash_to_int

BS, CS = 32, 128
PROMPT = list(range(1000, 1000 + 300))  # 2 full chunks + 44 tokens


def test_external_tokens_leave_the_last_prompt_token_to_vllm() -> None:
    p = Planner(BS, CS)
    assert p.external_tokens(300, 0, 256) == 256
    assert p.external_tokens(300, 64, 256) == 192
    assert p.external_tokens(256, 0, 256) == 255  # the whole prompt cached: compute the last one
    assert p.external_tokens(300, 256, 128) == 0  # vLLM's own hit is longer


def test_load_plan_covers_whole_chunks_and_skips_the_local_hit() -> None:
    p = Planner(BS, CS)
    blocks = list(range(50, 60))
    p.on_alloc(Admission("r", PROMPT, blocks, local_hit=64, external=192))
    plan, _ = p.step([])
    (load,) = plan.retrieves
    assert load.token_ids == PROMPT[:256] and load.block_ids == blocks[:8] and load.skip_tokens == 64
    assert p.step([])[0].retrieves == []  # handed out once


def test_whole_prompt_hit_loads_its_last_chunk_whole() -> None:
    p = Planner(BS, CS)
    prompt = PROMPT[:256]
    p.on_alloc(Admission("r", prompt, list(range(8)), local_hit=0, external=255))
    (load,) = p.step([])[0].retrieves
    assert load.token_ids == prompt and load.block_ids == list(range(8))


def test_stores_advance_by_whole_chunks_once_each() -> None:
    p = Planner(BS, CS)
    blocks = list(range(10))
    hashes = [bytes([i]) * 32 for i in range(10)]
    p.on_alloc(Admission("r", PROMPT, [], 0, 0))
    plan, _ = p.step([("r", 0, 100, PROMPT, blocks[:4], hashes[:3])])
    assert plan.stores == []  # 100 tokens: no full chunk yet
    plan, _ = p.step([("r", 100, 200, PROMPT, blocks, hashes[:9])])
    (store,) = plan.stores
    assert store.token_ids == PROMPT[:256] and store.block_ids == blocks[:8]
    assert store.block_hashes == [block_hash_to_int(h) for h in hashes[:8]]
    plan, _ = p.step([("r", 300, 1, [*PROMPT, 7], blocks, hashes[:9])])
    assert plan.stores == []  # 301 tokens: still 2 chunks, already stored


def test_loaded_chunks_are_not_stored_again() -> None:
    p = Planner(BS, CS)
    p.on_alloc(Admission("r", PROMPT, list(range(10)), local_hit=0, external=256))
    plan, _ = p.step([("r", 256, 44, PROMPT, list(range(10)), [])])
    assert len(plan.retrieves) == 1 and plan.stores == []


def test_missing_hashes_are_sent_as_none() -> None:
    p = Planner(BS, CS)
    p.on_alloc(Admission("r", PROMPT, [], 0, 0))
    (store,) = p.step([("r", 0, 300, PROMPT, list(range(10)), [b"x"])])[0].stores
    assert store.block_hashes is None


def test_allocation_records_name_each_block_once_with_its_tokens() -> None:
    p = Planner(BS, CS)
    p.on_alloc(Admission("r", PROMPT, [], 0, 0))
    _, (rec,) = p.step([("r", 0, 40, PROMPT, [7, 8], [])])
    assert rec.req_id == "r" and rec.new_block_ids == [7, 8] and rec.new_token_ids == PROMPT[:40]
    _, recs = p.step([("r", 40, 20, PROMPT, [7, 8], [])])
    assert recs == []
    _, (rec,) = p.step([("r", 60, 20, PROMPT, [7, 8, 9], [])])
    assert rec.new_block_ids == [9] and rec.new_token_ids == PROMPT[64:80]


def test_unknown_and_finished_requests_are_ignored() -> None:
    p = Planner(BS, CS)
    p.on_alloc(Admission("r", PROMPT, [], 0, 0))
    assert len(p) == 1 and p.finish("r") and not p.finish("r")
    plan, recs = p.step([("r", 0, 300, PROMPT, list(range(10)), [])])
    assert plan.stores == [] and recs == []


def test_chunk_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError):
        Planner(32, 48)


def test_block_hash_to_int_matches_vllm_int_hashes() -> None:
    h = bytes(range(32))
    assert block_hash_to_int(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert block_hash_to_int(-1) == (1 << 64) - 1


def test_chunks_the_workers_did_not_store_are_planned_again() -> None:
    p = Planner(BS, CS)
    blocks = list(range(10))
    p.on_alloc(Admission("r", PROMPT, blocks, local_hit=0, external=0))
    plan, _ = p.step([("r", 0, 300, PROMPT, blocks, [])])
    (store,) = plan.stores
    assert len(store.token_ids) == 256 and store.stored_before == 0
    assert p.step([("r", 300, 0, PROMPT, blocks, [])])[0].stores == []  # planned once ...
    p.not_stored("r", 130)  # ... but the workers stored only the first chunk (rounded down)
    (again,) = p.step([("r", 300, 0, PROMPT, blocks, [])])[0].stores
    assert len(again.token_ids) == 256 and again.stored_before == 128


def test_a_resumed_request_reports_its_new_blocks() -> None:
    p = Planner(BS, CS)
    p.on_alloc(Admission("r", PROMPT, [1, 2, 3], local_hit=0, external=0))
    _, records = p.step([("r", 0, 96, PROMPT, [1, 2, 3], [])])
    assert [r.new_block_ids for r in records] == [[1, 2, 3]]
    p.preempted("r")  # vLLM freed blocks 1-3; the request comes back with other blocks
    _, records = p.step([("r", 0, 64, PROMPT, [7, 8], [])])
    assert [r.new_block_ids for r in records] == [[7, 8]]


def test_a_finished_request_stores_its_last_chunk_in_the_next_step() -> None:
    """Async scheduling plans a step before the token it feeds is known: the chunk completed
    by a request's last step is stored once the request has finished, from blocks vLLM keeps."""
    p = Planner(BS, CS)
    blocks = list(range(10))
    p.on_alloc(Admission("r", PROMPT, blocks, local_hit=0, external=0))
    p.step([("r", 0, 300, PROMPT, blocks, [])])  # stores chunks 1-2 (256 tokens)
    tokens = PROMPT + list(range(90))  # 89 outputs fed: 389 tokens with KV, chunk 3 complete
    assert p.final_store("r", tokens, [*blocks, 10, 11, 12], 389, [])
    assert not p.final_store("r", tokens, blocks, 389, [])  # queued once
    (store,) = p.step([])[0].stores
    assert store.final and store.token_ids == tokens[:384] and store.stored_before == 256
    assert not p.final_store("r", tokens, blocks, 300, [])  # nothing left to store


def test_store_due_says_exactly_when_step_would_store() -> None:
    """The scheduler half skips reading vLLM's block table when no store is due (issue 42):
    ``store_due`` must be true in exactly the steps whose plan stores the request."""
    p = Planner(BS, CS)
    blocks = list(range(10))
    p.on_alloc(Admission("r", PROMPT, [], 0, 0))
    assert not p.store_due("unknown", 300, 300)
    for before, n in [(0, 100), (100, 27), (127, 1), (128, 1), (129, 126), (255, 1), (256, 44), (300, 1)]:
        tokens = [*PROMPT, 7][: max(before + n, len(PROMPT))]
        due = p.store_due("r", before + n, len(tokens))
        plan, _ = p.step([("r", before, n, tokens, blocks, [])])
        assert due == bool(plan.stores), (before, n)
    p.not_stored("r", 128)  # a store failed: the watermark drops, a store is due again
    assert p.store_due("r", 301, 301)
