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
    TransferTokens,
    consumer_params,
    producer_params,
    resolve_role,
)
from kvcache.integrations.vllm.stats import ConnectorTally

CS = 256


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
    assert ConnectorConfig.from_extra({}).transfer_wait_s == 5.0
    for bad in (0, -1, 10.0, 11):
        with pytest.raises(ValueError, match="transfer_wait_s"):
            ConnectorConfig.from_extra({"transfer_wait_s": bad, "timeout_s": 10.0})


def test_a_producer_names_its_stored_prompt_chunks_and_only_when_asked() -> None:
    asked = _request({"do_remote_decode": True})
    params = producer_params(False, asked, 512)
    ours = {PARAMS_KEY: {"v": 1, "tokens": 512}}
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, **ours}
    assert producer_params(False, _request(None), 512) is None  # kv_both, not asked: vLLM's default
    assert producer_params(True, _request(None), 512) is not None  # kv_producer: always
    assert producer_params(True, _request(None, prompt=300), 512)[PARAMS_KEY]["tokens"] == 300  # type: ignore[index]


def test_a_consumer_reads_a_count_and_cuts_it_to_its_own_prompt() -> None:
    tally = ConnectorTally()
    tokens = TransferTokens(tally)
    ok = _request({"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "tokens": 512}}, req_id="a")
    assert tokens.of(ok, 700, CS) == 512
    claim_past_prompt = _request({PARAMS_KEY: {"v": 1, "tokens": 4096}}, prompt=600, req_id="b")
    assert tokens.of(claim_past_prompt, 600, CS) == 512  # whole chunks of its own prompt only
    assert tokens.of(_request({"remote_engine_id": "x"}, req_id="c"), 700, CS) == 0  # not ours
    assert tokens.of(_request(None, req_id="d"), 700, CS) == 0
    totals = tally.totals()
    assert (totals["transfer_requests"], totals["transfer_awaited_tokens"]) == (2, 1024)


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
        [1, 512],
        "512",
    ],
)
def test_malformed_params_are_a_typed_error_and_change_nothing(body: Any) -> None:
    request = _request({PARAMS_KEY: body})
    with pytest.raises(ProtocolError):
        consumer_params(request)
    tally = ConnectorTally()
    tokens = TransferTokens(tally)
    assert tokens.of(request, 700, CS) == 0  # served as an ordinary request
    assert tokens.of(request, 700, CS) == 0  # read once: counted once
    assert tally.totals() == {"transfer_params_invalid": 1}
