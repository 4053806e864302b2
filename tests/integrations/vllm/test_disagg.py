"""Prefill/decode roles and transfer parameters (``integrations.vllm.disagg``), without vLLM.

The parameters come back from a client (a proxy copies them between instances), so they are
tested as hostile input: anything but a well-formed count is a typed error and changes
nothing, and nothing in them can name a chunk the consumer's own prompt does not key.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvcache.errors import ConfigError, ProtocolError
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.disagg import (
    MAX_TRANSFER_TOKENS,
    PARAMS_KEY,
    SplitRequests,
    asks_remote_decode,
    consumer_params,
    producer_params,
    resolve_role,
    tail_chunk,
    tail_extra,
)
from kvcache.integrations.vllm.stats import ConnectorTally

CS, BS = 256, 32
SECRET = "0123456789abcdef" * 2


def _request(params: Any, prompt: int = 700, req_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=list(range(prompt)))


def test_roles_decide_the_directions_and_unknown_roles_fail_at_start() -> None:
    cfg = ConnectorConfig.from_extra({})
    both = resolve_role(None, cfg)
    assert (both.load, both.store) == (True, True)
    producer = resolve_role("kv_producer", cfg)
    assert (producer.load, producer.store) == (False, True)
    consumer = resolve_role("kv_consumer", cfg)
    assert (consumer.load, consumer.store) == (True, False)
    asked = resolve_role("kv_consumer", ConnectorConfig.from_extra({"consumer_store": True}))
    assert asked.store  # only when the user asks for it
    assert not resolve_role("kv_both", ConnectorConfig.from_extra({"load": False})).load
    with pytest.raises(ConfigError, match="kv_role"):
        resolve_role("kv_decoder", cfg)


def test_transfer_wait_is_bounded_by_the_call_timeout() -> None:
    assert ConnectorConfig.from_extra({}).transfer_wait == 5.0
    assert ConnectorConfig.from_extra({"timeout_s": 1.0}).transfer_wait == 0.5  # a short timeout
    for bad in (0, -1, 10.0, 11):
        with pytest.raises(ValueError, match="transfer_wait_s"):
            ConnectorConfig.from_extra({"transfer_wait_s": bad, "timeout_s": 10.0})


def test_a_producer_names_its_stored_prompt_chunks_and_only_when_asked() -> None:
    asked = _request({"do_remote_decode": True})
    assert asks_remote_decode(False, asked) and asks_remote_decode(True, _request(None))
    assert not asks_remote_decode(False, _request(None))  # kv_both, not asked: vLLM's default
    ours = {PARAMS_KEY: {"v": 1, "tokens": 512}}
    assert producer_params(asked, 512) == {"do_remote_prefill": True, "do_remote_decode": False, **ours}
    assert producer_params(_request(None, prompt=300), 512)[PARAMS_KEY]["tokens"] == 300
    tail = producer_params(asked, 512, 160, SECRET)[PARAMS_KEY]
    assert tail == {"v": 1, "tokens": 512, "tail": 160, "secret": SECRET}


def test_the_tail_is_one_padded_chunk_under_a_key_no_ordinary_request_derives() -> None:
    prompt = list(range(1000, 1700))  # 2 whole chunks, then 188 tokens: 5 whole blocks (160)
    blocks = list(range(100, 122))
    tokens, ids = tail_chunk(prompt, 512, 160, blocks, CS, BS)
    assert tokens == prompt[512:672] + [prompt[671]] * 96 and len(tokens) == CS
    assert ids == blocks[16:21] + [blocks[20]] * 3 and len(ids) == CS // BS
    extra = tail_extra("lora=a@p", SECRET, prompt, 512)
    assert extra.startswith("lora=a@p;pd-tail=" + SECRET)
    assert tail_extra("lora=a@p", SECRET, [7, *prompt[1:]], 512) != extra  # bound to the prefix
    assert tail_extra("lora=a@p", SECRET[::-1], prompt, 512) != extra


def test_a_consumer_reads_a_count_and_cuts_it_to_its_own_prompt() -> None:
    tally = ConnectorTally()
    split = SplitRequests(tally)
    ok = _request({"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "tokens": 512}}, req_id="a")
    assert split.tokens(ok, 700, CS, BS) == 512
    claim_past_prompt = _request({PARAMS_KEY: {"v": 1, "tokens": 4096}}, prompt=600, req_id="b")
    assert split.tokens(claim_past_prompt, 600, CS, BS) == 512  # whole chunks of its own prompt only
    assert split.tokens(_request({"remote_engine_id": "x"}, req_id="c"), 700, CS, BS) == 0  # not ours
    assert split.tokens(_request(None, req_id="d"), 700, CS, BS) == 0
    tail = {"v": 1, "tokens": 512, "tail": 160, "secret": SECRET}
    assert split.tokens(_request({PARAMS_KEY: tail}, req_id="e"), 700, CS, BS) == 672
    assert split.get("e") == (512, 160, SECRET)
    # A tail that does not fit this prompt exactly is dropped, the whole chunks kept.
    for i, (prompt, bad) in enumerate([(600, {}), (700, {"tail": 150}), (700, {"tokens": 256})]):
        assert split.tokens(_request({PARAMS_KEY: tail | bad}, prompt, f"f{i}"), prompt, CS, BS) in (512, 256)
        assert split.get(f"f{i}").tail == 0
    totals = tally.totals()
    assert (totals["transfer_requests"], totals["transfer_awaited_tokens"]) == (6, 512 * 4 + 672 + 256)


@pytest.mark.parametrize(
    "body",
    [
        {"v": 1, "tokens": -256},  # negative length
        {"v": 1, "tokens": MAX_TRANSFER_TOKENS + 1},  # huge count
        {"v": 1, "tokens": "512"},  # wrong type
        {"v": 1, "tokens": 512.0},
        {"v": 2, "tokens": 512},  # a version we do not speak
        {"tokens": 512},
        {"v": 1, "tokens": 512, "cache_salt": "tenant-a"},  # no field may name another scope
        {"v": 1, "tokens": 512, "model_name": "other"},
        {"v": 1, "tokens": 512, "keys": ["00" * 16]},
        {"v": 1, "tokens": 512, "tail": 160},  # a tail without its secret
        {"v": 1, "tokens": 512, "tail": 160, "secret": "zz" * 16},
        {"v": 1, "tokens": 512, "tail": 160, "secret": SECRET + "00"},
        [1, 512],
        "512",
    ],
)
def test_malformed_params_are_a_typed_error_and_change_nothing(body: Any) -> None:
    request = _request({PARAMS_KEY: body})
    with pytest.raises(ProtocolError):
        consumer_params(request)
    tally = ConnectorTally()
    split = SplitRequests(tally)
    assert split.tokens(request, 700, CS, BS) == 0  # served as an ordinary request
    assert split.tokens(request, 700, CS, BS) == 0  # read once: counted once
    assert tally.totals() == {"transfer_params_invalid": 1}
