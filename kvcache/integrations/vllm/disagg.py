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

import hashlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np

from kvcache.errors import ConfigError, ProtocolError
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.plan import Planner, RetrieveSpec, StoreSpec
from kvcache.integrations.vllm.request_keys import request_key_extra
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
    """The value under ``PARAMS_KEY``: ``v`` the format's version; ``tokens`` the leading
    prompt tokens the prefill instance stored or is storing (a multiple of the chunk size);
    ``tail`` the whole blocks after them it stored as one tail chunk, keyed by ``secret``
    (see ``tail_extra``), 0 for none."""

    v: Literal[1]
    tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_TOKENS)]
    tail: Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_TOKENS)] = 0
    secret: Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{32})?$")] = ""


class Awaited(NamedTuple):
    """What a decode request waits for: ``whole`` prompt tokens in whole chunks, then
    ``tail`` tokens in the tail chunk keyed by ``secret`` (0: none)."""

    whole: int = 0
    tail: int = 0
    secret: str = ""


def producer_params(request: Any, stored_tokens: int, tail: int = 0, secret: str = "") -> dict[str, Any]:
    """What ``request_finished`` returns for a prefill request (``asks_remote_decode``).
    ``do_remote_prefill`` tells the decode instance's vLLM (and any proxy) that its prompt was
    prefilled elsewhere, as vLLM's P/D connectors say it."""
    tokens = min(stored_tokens, len(request.prompt_token_ids or ()))
    ours: dict[str, Any] = {"v": 1, "tokens": tokens}
    if tail:
        ours |= {"tail": tail, "secret": secret}
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: ours}


def asks_remote_decode(role_producer: bool, request: Any) -> bool:
    """Whether a finished request gets transfer parameters: always from a ``kv_producer``;
    under ``kv_both`` when it asked for a remote decode (``do_remote_decode``)."""
    asked = request.kv_transfer_params
    return role_producer or (isinstance(asked, dict) and bool(asked.get("do_remote_decode")))


def consumer_params(request: Any) -> TransferParams | None:
    """The parameters a decode request carries, or None when it carries none of ours.
    ``ProtocolError`` for a malformed entry (wrong types, unknown fields, counts out of range,
    a tail without its secret): the caller treats the request as an ordinary one."""
    raw = request.kv_transfer_params
    if not isinstance(raw, dict) or raw.get(PARAMS_KEY) is None:
        return None
    try:
        params = msgspec.convert(raw[PARAMS_KEY], TransferParams, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from exc
    if bool(params.tail) != bool(params.secret):
        raise ProtocolError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: a tail needs its secret")
    return params


def awaited(params: TransferParams, num_prompt_tokens: int, chunk_size: int, block_size: int) -> Awaited:
    """What to wait for: the claim cut to the whole chunks of this prompt (a claim past the
    prompt names no chunk this request has: its keys come from its own tokens), and the tail
    only where it fits this prompt exactly (after every whole chunk, whole blocks, within it)
    and in the blocks vLLM will allocate for the tokens promised to it: all but the prompt's
    last token (``Planner.external_tokens``). A prompt that ends on a block boundary with
    one-token blocks gets one block fewer than its tail, and the padded tail chunk would copy
    its last token's KV into the block before it (``tail_chunk`` pads the ids with the last
    one given), a block vLLM takes as loaded."""
    whole = min(params.tokens, num_prompt_tokens) // chunk_size * chunk_size
    tail = params.tail
    end = whole + tail
    fits = whole == num_prompt_tokens // chunk_size * chunk_size and end <= num_prompt_tokens
    allocated = -(-min(end, num_prompt_tokens - 1) // block_size)  # blocks of the promised tokens
    if not (tail and fits and tail % block_size == 0 and tail < chunk_size and allocated * block_size >= end):
        return Awaited(whole)
    return Awaited(whole, tail, params.secret)


def tail_extra(key_extra: str, secret: str, prompt: Sequence[int], whole: int) -> str:
    """The ``key_extra`` of a prompt's tail chunk: the request's own, the per-request secret
    and a digest of the prompt before the tail. Its chunk key (the padded tail's tokens under
    that scope) is one no ordinary request derives: a lookup never finds it, and a decode
    request finds it only with the secret and the same prompt."""
    digest = hashlib.blake2b(np.asarray(prompt[:whole], dtype="<i8").tobytes(), digest_size=16)
    return f"{key_extra};pd-tail={secret};prefix={digest.hexdigest()}"


def tail_chunk(prompt: Sequence[int], whole: int, tail: int, block_ids: Sequence[int],
               chunk_size: int, block_size: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """The tail as one whole chunk: its tokens padded with its last token, its block ids
    (from the request's ``block_ids``) padded with its last block, so the daemon copies whole
    chunks only and every byte in the chunk is the tail's own (a decode instance's padded
    slots receive copies of its last tail block, written into that same block). Only the
    padding slots are padded: ``block_ids`` short of the tail give fewer ids than the chunk
    needs, which the daemon refuses, never another tail block's slot filled with the last one."""
    tokens = list(prompt[whole : whole + tail])
    ids = list(block_ids[whole // block_size : (whole + tail) // block_size])
    return tokens + tokens[-1:] * (chunk_size - tail), ids + ids[-1:] * ((chunk_size - tail) // block_size)


class SplitRequests:
    """The scheduler half's requests of a split: what each decode request's transfer
    parameters name (read once per request, counted in ``tally``)."""

    def __init__(self, tally: ConnectorTally) -> None:
        self._tally = tally
        self._awaited: dict[str, Awaited] = {}

    def tokens(self, request: Any, num_prompt_tokens: int, chunk_size: int, block_size: int) -> int:
        """The prompt tokens to wait for (0: no parameters of ours, or malformed ones: the
        request is then served as an ordinary one, and counted)."""
        req_id = request.request_id
        if req_id not in self._awaited:
            try:
                params = consumer_params(request)
            except ProtocolError as exc:
                log.warning("kvcache: request %s: %s", req_id, exc)
                self._tally.count("transfer_params_invalid")
                params = None
            got = awaited(params, num_prompt_tokens, chunk_size, block_size) if params else Awaited()
            self._awaited[req_id] = got
            if params is not None:
                self._tally.count("transfer_requests")
                self._tally.count("transfer_awaited_tokens", got.whole + got.tail)
        got = self._awaited[req_id]
        return got.whole + got.tail

    def get(self, req_id: str) -> Awaited:
        return self._awaited.get(req_id, Awaited())

    def forget(self, req_id: str) -> None:
        self._awaited.pop(req_id, None)

    def tail_load(self, planner: Planner, request: Any, block_ids: Sequence[int], local: int,
                  key_extra: str, wait_ms: int) -> None:  # fmt: skip
        """Queue a decode request's load of its tail chunk (after ``planner.on_alloc``
        queued its whole chunks'), unless vLLM's own hit covers the tail or it was given no
        blocks (nothing external to load)."""
        got = self.get(request.request_id)
        bs, cs = planner.block_size, planner.chunk_size
        if not got.tail or not block_ids or local >= got.whole + got.tail:
            return
        prompt = request.prompt_token_ids
        tokens, ids = tail_chunk(prompt, got.whole, got.tail, block_ids, cs, bs)
        skip = max(0, local - got.whole) // bs * bs
        extra = tail_extra(key_extra, got.secret, prompt, got.whole)
        spec = RetrieveSpec(request.request_id, tokens, ids, skip, request.cache_salt or "", extra,
                            True, (1, wait_ms, got.tail))  # fmt: skip
        planner.queue_retrieve(spec)

    def finished(self, producer: bool, planner: Planner, request: Any, block_ids: Sequence[int],
                 written: int) -> tuple[dict[str, Any] | None, bool]:  # fmt: skip
        """A finished request with ``written`` tokens' KV in ``block_ids`` (its stores queued):
        its transfer parameters, and whether a tail store was queued (vLLM must keep its
        blocks until it settles), for a prefill request (``asks_remote_decode``)."""
        if not asks_remote_decode(producer, request):
            return None, False
        stored = planner.stored(request.request_id)
        tail, secret = self.tail_store(planner, request, block_ids, stored, written)
        return producer_params(request, stored, tail, secret), tail > 0

    def tail_store(self, planner: Planner, request: Any, block_ids: Sequence[int], whole: int,
                   written: int) -> tuple[int, str]:  # fmt: skip
        """Queue a prefill request's store of its prompt's tail chunk (whole blocks after its
        ``whole`` chunk-aligned tokens); returns (tail tokens, secret), (0, "") for none."""
        prompt, bs, cs = request.prompt_token_ids or [], planner.block_size, planner.chunk_size
        key_extra = request_key_extra(request)
        tail = (min(len(prompt), written) - whole) // bs * bs
        fits = whole == len(prompt) // cs * cs and tail > 0 and (whole + tail) // bs <= len(block_ids)
        if key_extra is None or not fits:
            return 0, ""
        secret = secrets.token_hex(16)
        tokens, ids = tail_chunk(prompt, whole, tail, block_ids, cs, bs)
        extra = tail_extra(key_extra, secret, prompt, whole)
        planner.queue_final_store(StoreSpec(request.request_id, tokens, ids, None, request.cache_salt or "",
                                            0, extra, final=True))  # fmt: skip
        return tail, secret


__all__ = [
    "MAX_TRANSFER_TOKENS",
    "PARAMS_KEY",
    "ROLES",
    "Awaited",
    "SplitRequests",
    "TransferParams",
    "asks_remote_decode",
    "awaited",
    "consumer_params",
    "producer_params",
    "resolve_role",
    "tail_chunk",
    "tail_extra",
]
