"""``SharedLoads``: which request may wait for another's load in flight (the scheduler half's
side of it; under vLLM's scheduler: the harness's ``shared_load`` scenario)."""

from __future__ import annotations

from types import SimpleNamespace

from kvcache.integrations.vllm.shared_loads import SharedLoads

CHUNK = 64
PREFIX = list(range(1000, 1000 + 3 * CHUNK))


def _req(req_id: str, prompt: list[int], salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, cache_salt=salt)


def test_a_request_waits_only_for_a_load_of_its_own_next_chunk_in_its_scope() -> None:
    loads = SharedLoads()
    loads.started(_req("a", [*PREFIX, 1, 2]), 3 * CHUNK, "")
    same = _req("b", [*PREFIX, 7])
    assert loads.behind(same, 0, CHUNK, "") == "a"
    assert loads.behind(same, 2 * CHUNK, CHUNK, "") == "a"  # past vLLM's own hit too
    assert loads.behind(same, 3 * CHUNK, CHUNK, "") is None  # a chunk the load does not bring
    assert loads.behind(_req("a", [*PREFIX]), 0, CHUNK, "") is None  # never behind itself
    assert loads.behind(same, 0, CHUNK, "lora-1") is None  # another key_extra: other chunks
    assert loads.behind(_req("c", [*PREFIX], "tenant"), 0, CHUNK, "") is None  # another salt
    other = _req("d", [*PREFIX[:CHUNK], *[5] * (2 * CHUNK)])
    assert loads.behind(other, 0, CHUNK, "") == "a"  # shares the first chunk
    assert loads.behind(other, CHUNK, CHUNK, "") is None  # diverges in the second
    assert loads.behind(_req("e", PREFIX[: CHUNK - 1]), 0, CHUNK, "") is None  # no whole chunk
    loads.ended(["a"])
    assert loads.behind(same, 0, CHUNK, "") is None and len(loads) == 0
