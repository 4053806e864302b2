"""The proxy's HTTP server (aiohttp): the two upstream calls per request, relaying, errors.

Every decision (which instance, what body, which error) comes from ``routing``; this module
only does the I/O. aiohttp serves and calls upstream in one event loop, streams without
buffering, and bounds each phase of a call with its own timeout.

Answers, by cause:

* the client's body is not a JSON object, or ``stream`` is not a boolean: 400, no call made;
* an instance answers 4xx/5xx: that status and body, as they came;
* an instance cannot be reached, drops the connection, or its prefill answer is unusable: 502;
* an instance stays silent past its timeout: 504;
* a decode instance fails after part of a stream was relayed: the stream ends with an error
  event and ``[DONE]`` (the status line has already gone out as 200).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvcache.errors import ProxyRequestError, UpstreamError
from kvcache.integrations.vllm.proxy.routing import (
    GENERATE_PATHS,
    Pool,
    ProxyConfig,
    decode_body,
    error_body,
    parse_request,
    prefill_body,
    split_events,
    stream_error_event,
    transfer_params,
)

log = logging.getLogger("kvcache.proxy")

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
"""Client headers both instances get: the API key, and one request id for both halves (the
proxy makes one when the client sent none), so the two servers' logs name the same request."""


class Proxy:
    """The pools and the one client session, shared by every handler of one app."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Pool.of(config.prefill)
        self.decode = Pool.of(config.decode)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "used before the app started"
        return self._session

    async def start(self, _app: web.Application) -> None:
        # No pool limit: the instances, not the proxy, decide how much they take at once.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        c = self.config
        return aiohttp.ClientTimeout(total=total, connect=c.connect_s, sock_read=c.read_s)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` and ``/v1/chat/completions``: prefill, then decode."""
        try:
            body = parse_request(await request.read())
        except ProxyRequestError as exc:
            return web.Response(
                status=exc.status,
                body=error_body(str(exc), "invalid_request_error", 400),
                content_type="application/json",
            )
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        headers.setdefault("X-Request-Id", f"kvcache-proxy-{uuid.uuid4().hex}")
        try:
            t0 = time.perf_counter()
            params = await self._prefill(request.path, body, headers)
            timing = f"prefill;dur={(time.perf_counter() - t0) * 1e3:.1f}"
            return await self._decode(request, body, params, headers, timing)
        except UpstreamError as exc:
            return web.Response(status=exc.status, body=exc.body, headers=exc.headers)

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | None:
        """The prefill call; its ``kv_transfer_params``, or the client's answer as an exception."""
        with self.prefill.pick() as up:
            url = up.url + path
            try:
                async with self.session.post(
                    url,
                    json=prefill_body(body, path),
                    headers=headers,
                    timeout=self._timeout(self.config.prefill_s),
                ) as resp:
                    raw = await resp.read()
                    if resp.status >= 400:
                        raise _passed_through(resp, raw)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _failed("prefill", up.url, exc) from None
        try:
            return transfer_params(raw)
        except ValueError as exc:
            raise _upstream_error(502, f"prefill instance {up.url}: {exc}", "upstream_bad_answer") from None

    async def _decode(
        self,
        request: web.Request,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        headers: dict[str, str],
        timing: str,
    ) -> web.StreamResponse:
        """The decode call, relayed: whole, or event by event for a streaming client; the
        answer carries ``Server-Timing: prefill;dur=<ms>``, the prefill call's share of it."""
        with self.decode.pick() as up:
            try:
                resp = await self.session.post(
                    up.url + request.path,
                    json=decode_body(body, params),
                    headers=headers,
                    timeout=self._timeout(),
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _failed("decode", up.url, exc) from None
            async with resp:
                if resp.status < 400 and body.get("stream", False):
                    return await self._relay(request, resp, up.url, timing)
                try:
                    raw = await resp.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise _failed("decode", up.url, exc) from None
                if resp.status >= 400:
                    raise _passed_through(resp, raw)
                return _copy(resp, raw, timing)

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, url: str, timing: str
    ) -> web.StreamResponse:
        """Relay a stream event by event as its bytes arrive. A client that hangs up ends the
        relay, and leaving the upstream response unread closes it, so vLLM aborts the request."""
        out = web.StreamResponse(
            status=resp.status,
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "Server-Timing": timing,
            },
        )
        await out.prepare(request)
        pending = b""
        try:
            while True:
                try:
                    data = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    why = "timed out" if isinstance(exc, TimeoutError) else f"failed: {_describe(exc)}"
                    log.warning("decode instance %s %s mid-stream", url, why)
                    await out.write(stream_error_event(f"decode instance {url} {why} mid-stream"))
                    break
                if not data:
                    if pending:
                        await out.write(pending)
                    break
                ready, pending = split_events(pending + data)
                if ready:
                    await out.write(ready)
            await out.write_eof()
        except ConnectionResetError:
            log.info("client hung up during a stream from %s", url)
        return out

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``/v1/models`` from a decode instance, as it answered."""
        with self.decode.pick() as up:
            try:
                async with self.session.get(
                    up.url + "/v1/models", headers=_auth(request), timeout=self._timeout(self.config.health_s)
                ) as resp:
                    return _copy(resp, await resp.read())
            except (TimeoutError, aiohttp.ClientError) as exc:
                msg = f"decode instance {up.url} failed: {_describe(exc)}"
                return web.Response(
                    status=502,
                    body=error_body(msg, "upstream_unreachable", 502),
                    content_type="application/json",
                )

    async def health(self, _request: web.Request) -> web.Response:
        """200 while at least one instance of each kind answers its ``/health`` with 200; the
        body says what each one answered."""
        urls = [
            (kind, u.url)
            for kind, pool in (("prefill", self.prefill), ("decode", self.decode))
            for u in pool.upstreams
        ]
        states = await asyncio.gather(*(self._health_of(url) for _, url in urls))
        report: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
        for (kind, url), state in zip(urls, states, strict=True):
            report[kind][url] = state
        healthy = all("ok" in by_url.values() for by_url in report.values())
        return web.json_response(report, status=200 if healthy else 503)

    async def _health_of(self, url: str) -> str:
        try:
            async with self.session.get(url + "/health", timeout=self._timeout(self.config.health_s)) as resp:
                return "ok" if resp.status == 200 else f"status {resp.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"unreachable: {_describe(exc)}"


def _failed(kind: str, url: str, exc: BaseException) -> UpstreamError:
    """504 for an instance that stayed silent past its timeout, 502 for any other failure."""
    if isinstance(exc, TimeoutError):
        return _upstream_error(504, f"{kind} instance {url} timed out", "upstream_timeout")
    return _upstream_error(502, f"{kind} instance {url} failed: {_describe(exc)}", "upstream_unreachable")


def _upstream_error(status: int, message: str, kind: str) -> UpstreamError:
    """The proxy's own answer for a failed upstream call (logged: the client sees only it)."""
    log.warning("%s", message)
    body = error_body(message, kind, status)
    return UpstreamError(message, status, body, {"Content-Type": "application/json"})


def _passed_through(resp: aiohttp.ClientResponse, raw: bytes) -> UpstreamError:
    """An instance's own error answer (4xx/5xx), relayed as it came."""
    message = f"upstream answered {resp.status}"
    return UpstreamError(message, resp.status, raw, _copied_headers(resp))


def _copy(resp: aiohttp.ClientResponse, raw: bytes, timing: str | None = None) -> web.Response:
    """An upstream answer as the client gets it: status, body and content type."""
    headers = _copied_headers(resp)
    if timing is not None:
        headers["Server-Timing"] = timing
    return web.Response(status=resp.status, body=raw, headers=headers)


def _copied_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {"Content-Type": resp.headers.get("Content-Type", "application/json")}


def _auth(request: web.Request) -> dict[str, str]:
    return {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def build_app(config: ProxyConfig) -> web.Application:
    proxy = Proxy(config)
    app = web.Application(client_max_size=64 << 20)  # long prompts as token ids are large
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    for path in GENERATE_PATHS:
        app.router.add_post(path, proxy.generate)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    return app
