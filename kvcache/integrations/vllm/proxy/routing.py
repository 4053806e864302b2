"""What the proxy decides, without doing any I/O: its configuration, which instance serves a
request, how a client's request becomes the prefill call and the decode call, and the error
bodies it answers with.

Separate from ``app`` so that every rule here is plain Python, checked by fast tests in any
environment; ``app`` only moves bytes between sockets according to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvcache.errors import ConfigError, ProxyRequestError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE_PATHS = (COMPLETIONS, CHAT)

PREFILL_DROPS = ("stream_options", "min_tokens")
"""Client fields the prefill call leaves out: vLLM refuses ``stream_options`` without
``stream`` and ``min_tokens`` above ``max_tokens``; neither changes the prompt's KV."""


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"instance URL {url!r} is not http(s)://host[:port]")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"instance URL {url!r} must name only a server (no path, query or fragment)")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise ConfigError(f"instance URL {url!r}: {exc}") from None
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's settings, validated on construction (a ``ConfigError`` names the bad one).

    Timeouts bound every upstream call so that a client never waits forever: ``connect_s`` to
    open a connection, ``prefill_s`` for a whole prefill call, ``read_s`` for the longest
    silence of a decode instance (between two chunks of a stream, or before a whole answer).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    connect_s: float = 10.0
    prefill_s: float = 600.0
    read_s: float = 600.0
    health_s: float = 5.0

    def __post_init__(self) -> None:
        for kind in ("prefill", "decode"):
            urls = getattr(self, kind)
            if not urls:
                raise ConfigError(f"at least one {kind} instance is needed")
            checked = tuple(_check_url(u) for u in urls)
            if len(set(checked)) != len(checked):
                raise ConfigError(f"a {kind} instance is listed twice: {', '.join(urls)}")
            object.__setattr__(self, kind, checked)
        for name in ("connect_s", "prefill_s", "read_s", "health_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")


@dataclass
class Upstream:
    """One vLLM instance and the requests the proxy has in flight on it."""

    url: str
    in_flight: int = 0
    served: int = 0


@dataclass
class Pool:
    """Instances of one kind; ``pick`` lends the one with the fewest requests in flight.

    Least-in-flight suits the split: a decode request holds its instance for its whole
    stream, so counting what is in flight follows the real load where plain rotation would
    pile long streams on one instance. Ties (an idle pool, equal loads) go round robin, so
    requests that finish fast still spread evenly. One event loop thread uses a pool.
    """

    upstreams: list[Upstream]
    _next: int = field(default=0)

    @classmethod
    def of(cls, urls: Sequence[str]) -> Pool:
        return cls([Upstream(u) for u in urls])

    @contextmanager
    def pick(self) -> Iterator[Upstream]:
        n = len(self.upstreams)
        order = [self.upstreams[(self._next + i) % n] for i in range(n)]
        chosen = min(order, key=lambda u: u.in_flight)  # the first of equals: rotation order
        self._next = (self.upstreams.index(chosen) + 1) % n
        chosen.in_flight += 1
        chosen.served += 1
        try:
            yield chosen
        finally:
            chosen.in_flight -= 1


def parse_request(raw: bytes) -> dict[str, Any]:
    """The client's JSON body; the proxy reads only ``stream`` and leaves the rest to vLLM."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProxyRequestError(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyRequestError("the request body must be a JSON object")
    if not isinstance(body.get("stream", False), bool):
        raise ProxyRequestError("'stream' must be true or false")
    return body


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The prefill call: the prompt's KV and one token, answered whole. Whatever
    ``kv_transfer_params`` the client sent are replaced: only the proxy sets them."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    out.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if path == CHAT:
        out["max_completion_tokens"] = 1
    return out


def transfer_params(raw: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer; None where it carries none (a connector
    that needs none, such as kvcache's ``kv_both``, where the decode side looks the prompt up)."""
    try:
        answer = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the prefill instance answered with something other than JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise ValueError("the prefill instance's answer is not a JSON object")
    params = answer.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"the prefill instance's kv_transfer_params is not an object: {params!r}")
    return params


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode call: the client's request as sent, with the prefill side's parameters
    (exactly as received) in place of any the client put there."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def error_body(message: str, kind: str, status: int) -> bytes:
    """An OpenAI-shaped error, as vLLM's own server writes them."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


def stream_error_event(message: str) -> bytes:
    """What ends a stream whose decode instance failed after the first bytes were relayed:
    an error event, then ``[DONE]``, the way vLLM ends a stream that failed in its engine."""
    event = json.dumps({"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}})
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


def split_events(buffer: bytes) -> tuple[bytes, bytes]:
    """``buffer`` cut after its last complete SSE event: (what can be relayed, what waits for
    more bytes). Relaying whole events only means a stream cut short is never left mid-line."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.rfind(sep)) >= 0]
    cut = max(ends, default=0)
    return buffer[:cut], buffer[cut:]
