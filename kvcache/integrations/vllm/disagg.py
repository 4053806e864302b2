"""Prefill/decode disaggregation: the connector's role, and the transfer parameters between a
prefill instance (``kv_producer``) and a decode instance (``kv_consumer``). See
docs/disaggregation.md.

Separate from the connector because it is one contract with one rule: the parameters are
client-supplied (a proxy copies them from the prefill instance's response into the decode
request), so they carry no key, salt or model and nothing the daemon trusts. They carry only a
count: how many leading prompt tokens the prefill instance stored (or is storing), in whole
chunks. The decode instance keys those chunks itself, from its own prompt, request facts and
registration, exactly as a lookup would: a count can make it wait for chunks it may read
anyway, never read a chunk it could not. The wait is bounded (``transfer_wait_s``) and lives
in the daemon (``m.Retrieve.await_chunks``), on an asynchronous load, so the decode
instance's other requests keep decoding while one waits.

Follows vLLM's own P/D convention (its NIXL connector and toy proxy): the proxy sends the
prefill instance the request with ``max_tokens=1`` and ``{"do_remote_decode": true}``, and the
decode instance the original request with the ``kv_transfer_params`` the prefill answered.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Annotated, Any, Literal

import msgspec

from kvcache.errors import ConfigError, ProtocolError
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.stats import ConnectorTally

log = logging.getLogger("kvcache.integrations.vllm")

ROLES = ("kv_producer", "kv_consumer", "kv_both")
PARAMS_KEY = "kvcache"
"""Our entry in vLLM's ``kv_transfer_params`` (other connectors' entries pass through)."""
MAX_TRANSFER_TOKENS = 1 << 24
"""Bound on a claimed token count: a larger one is malformed, not clamped."""


def resolve_role(kv_role: str | None, config: ConnectorConfig) -> ConnectorConfig:
    """``config`` with ``load`` / ``store`` as vLLM's ``kv_role`` allows: a producer never
    loads; a consumer never stores unless ``consumer_store`` asks for it; ``kv_both`` (the
    default) does what the config says. ``ConfigError`` for a role vLLM does not define."""
    role = kv_role or "kv_both"
    if role not in ROLES:
        raise ConfigError(f"unknown kv_role {role!r}; the kvcache connector knows {list(ROLES)}")
    load = config.load and role != "kv_producer"
    store = config.store and (role != "kv_consumer" or config.consumer_store)
    return replace(config, load=load, store=store)


class TransferParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The value under ``PARAMS_KEY``: ``v`` the format's version, ``tokens`` the leading
    prompt tokens the prefill instance stored or is storing (a multiple of the chunk size)."""

    v: Literal[1]
    tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_TOKENS)]


def producer_params(role_producer: bool, request: Any, stored_tokens: int) -> dict[str, Any] | None:
    """What ``request_finished`` returns for a finished request: our parameters when this is a
    ``kv_producer`` or the request asked for a remote decode (``do_remote_decode``), else
    None. ``do_remote_prefill`` tells the decode instance's vLLM (and any proxy) that its
    prompt was prefilled elsewhere, as vLLM's P/D connectors say it."""
    asked = request.kv_transfer_params
    if not role_producer and not (isinstance(asked, dict) and asked.get("do_remote_decode")):
        return None
    prompt = len(request.prompt_token_ids or ())
    tokens = min(stored_tokens, prompt)
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: {"v": 1, "tokens": tokens}}


def consumer_params(request: Any) -> TransferParams | None:
    """The parameters a decode request carries, or None when it carries none of ours.
    ``ProtocolError`` for a malformed entry (wrong types, unknown fields, counts out of range):
    the caller treats the request as an ordinary one."""
    raw = request.kv_transfer_params
    if not isinstance(raw, dict) or raw.get(PARAMS_KEY) is None:
        return None
    try:
        return msgspec.convert(raw[PARAMS_KEY], TransferParams, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from exc


def awaited_tokens(params: TransferParams, num_prompt_tokens: int, chunk_size: int) -> int:
    """The leading prompt tokens to wait for: the claim, cut to the whole chunks of this
    prompt. A claim past the prompt names no chunk this request has (its keys come from
    its own tokens), so it is cut rather than trusted."""
    return min(params.tokens, num_prompt_tokens) // chunk_size * chunk_size


class TransferTokens:
    """The scheduler half's decode requests: the prompt tokens each one's transfer parameters
    name, read once per request and counted in ``tally``."""

    def __init__(self, tally: ConnectorTally) -> None:
        self._tally = tally
        self._tokens: dict[str, int] = {}

    def of(self, request: Any, num_prompt_tokens: int, chunk_size: int) -> int:
        """The tokens to wait for (0: no parameters of ours, or malformed ones: the request
        is then served as an ordinary one, and counted)."""
        req_id = request.request_id
        if req_id not in self._tokens:
            try:
                params = consumer_params(request)
            except ProtocolError as exc:
                log.warning("kvcache: request %s: %s", req_id, exc)
                self._tally.count("transfer_params_invalid")
                params = None
            tokens = awaited_tokens(params, num_prompt_tokens, chunk_size) if params is not None else 0
            self._tokens[req_id] = tokens
            if params is not None:
                self._tally.count("transfer_requests")
                self._tally.count("transfer_awaited_tokens", tokens)
        return self._tokens[req_id]

    def get(self, req_id: str) -> int:
        return self._tokens.get(req_id, 0)

    def forget(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)


__all__ = [
    "MAX_TRANSFER_TOKENS",
    "PARAMS_KEY",
    "ROLES",
    "TransferParams",
    "TransferTokens",
    "awaited_tokens",
    "consumer_params",
    "producer_params",
    "resolve_role",
]
