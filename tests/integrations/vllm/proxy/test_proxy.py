"""The proxy as a real process between a real HTTP client and real (small, OpenAI-shaped)
upstream servers: the two calls and their bodies, ``kv_transfer_params`` forwarded exactly,
streams relayed event by event, errors passed through, balancing over two of each kind,
bounded waits, and a graceful stop.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvcache.integrations.vllm.proxy.launch import ProxyProcess
from tests.integrations.vllm.proxy.upstream import Call, FakeVllm, Script

TIMEOUTS = [
    "--connect-timeout",
    "2",
    "--prefill-timeout",
    "2",
    "--read-timeout",
    "2",
    "--health-timeout",
    "2",
]
PARAMS = {"chunks": ["a1", "b2"], "tail": {"tokens": 37, "key": "ü-é"}, "ratio": 0.125, "n": None}


@dataclass
class World:
    calls: list[Call]
    prefill: list[FakeVllm]
    decode: list[FakeVllm]
    proxy: ProxyProcess

    def reset(self) -> None:
        self.calls.clear()
        for f in self.prefill + self.decode:
            f.script = Script(kv_params=dict(PARAMS, instance=f.name))

    def script(self, kind: str, **fields: Any) -> None:
        """Script every instance of ``kind``: which one the balancer picks next depends on
        the tests before (the proxy lives for the module)."""
        for f in getattr(self, kind):
            for name, value in fields.items():
                setattr(f.script, name, value)

    def servers(self) -> list[str]:
        return [c.server for c in self.calls]


@pytest.fixture(scope="module")
def world(proxy_python: str) -> Iterator[World]:
    calls: list[Call] = []
    prefill = [FakeVllm("p0", calls), FakeVllm("p1", calls)]
    decode = [FakeVllm("d0", calls), FakeVllm("d1", calls)]
    proxy = ProxyProcess(proxy_python, [f.url for f in prefill], [f.url for f in decode], TIMEOUTS)
    yield World(calls, prefill, decode, proxy)
    proxy.kill()
    for f in prefill + decode:
        f.close()


@pytest.fixture
def w(world: World) -> Iterator[World]:
    world.reset()
    yield world
    for f in world.prefill + world.decode:  # release anything a test left waiting
        if f.script.stall is not None:
            f.script.stall.set()
        for gate in f.script.gates.values():
            gate.set()


def request(base: str, path: str, body: Any, headers: dict[str, str] | None = None,
            method: str = "POST") -> http.client.HTTPResponse:  # fmt: skip
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def events(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of an SSE stream, each as soon as its blank line arrives."""
    lines: list[str] = []
    while line := resp.readline():
        text = line.decode().rstrip("\r\n")
        if text:
            lines.append(text)
            continue
        if lines:
            yield "\n".join(x.removeprefix("data: ") for x in lines)
            lines = []


BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "min_tokens": 4, "temperature": 0.0}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_with_the_params_exactly(w: World, path: str) -> None:
    sent = dict(BODY, stream=False, kv_transfer_params={"forged": True}, extra={"kept": [1, 2]})
    resp = request(w.proxy.url, path, sent, {"Authorization": "Bearer k"})
    assert resp.status == 200
    first, second = w.calls
    assert json.loads(resp.read())["choices"][0]["text"] == f"{second.server} answers"
    assert (first.server[0], first.path, second.server[0], second.path) == ("p", path, "d", path)
    want_prefill = {k: v for k, v in sent.items() if k != "min_tokens"}
    want_prefill.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if path == "/v1/chat/completions":
        want_prefill["max_completion_tokens"] = 1
    assert first.body == want_prefill
    assert second.body == dict(sent, kv_transfer_params=dict(PARAMS, instance=first.server))
    assert first.headers["Authorization"] == second.headers["Authorization"] == "Bearer k"
    assert first.headers["X-Request-Id"] == second.headers["X-Request-Id"]
    assert resp.getheader("Server-Timing", "").startswith("prefill;dur=")


def test_no_params_from_prefill_means_none_to_decode(w: World) -> None:
    w.script("prefill", kv_params=None)
    assert request(w.proxy.url, "/v1/completions", dict(BODY, kv_transfer_params={"x": 1})).status == 200
    assert "kv_transfer_params" not in w.calls[1].body


def test_a_stream_is_relayed_event_by_event(w: World) -> None:
    """Event 1 leaves the decode server only after the client has read event 0 through the
    proxy: a proxy that buffered would hang here (and fail on its read timeout)."""
    gate = threading.Event()
    w.script("decode", gates={1: gate})
    sent = dict(BODY, stream=True, stream_options={"include_usage": True})
    resp = request(w.proxy.url, "/v1/completions", sent)
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    assert float(resp.getheader("Server-Timing", "").removeprefix("prefill;dur=")) >= 0
    got = events(resp)
    d = w.calls[1].server
    assert json.loads(next(got))["choices"][0]["text"] == f"{d}-0"
    gate.set()
    assert [json.loads(e)["choices"][0]["text"] for e in [next(got), next(got)]] == [f"{d}-1", f"{d}-2"]
    assert list(got) == ["[DONE]"]
    assert "stream_options" not in w.calls[0].body and w.calls[0].body["stream"] is False
    assert w.calls[1].body == dict(sent, kv_transfer_params=dict(PARAMS, instance=w.calls[0].server))


def test_a_decode_server_dying_mid_stream_ends_the_stream_with_an_error(w: World) -> None:
    w.script("decode", die_after=2)
    got = list(events(request(w.proxy.url, "/v1/completions", dict(BODY, stream=True))))
    d = w.calls[1].server
    assert [json.loads(e)["choices"][0]["text"] for e in got[:2]] == [f"{d}-0", f"{d}-1"]
    error = json.loads(got[2])["error"]
    assert error["code"] == 502 and "decode instance http://127.0.0.1:" in error["message"]
    assert got[3:] == ["[DONE]"]  # the half event never reaches the client


def test_a_silent_decode_server_is_cut_off_mid_stream(w: World) -> None:
    w.script("decode", gates={1: threading.Event()})  # never set: silence after event 0
    got = list(events(request(w.proxy.url, "/v1/completions", dict(BODY, stream=True))))
    assert json.loads(got[0])["choices"][0]["text"] == f"{w.calls[1].server}-0"
    assert "timed out" in json.loads(got[1])["error"]["message"] and got[2:] == ["[DONE]"]


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_errors_pass_through(w: World, stream: bool) -> None:
    body = json.dumps({"error": {"message": "prompt too long", "code": 400}}).encode()
    w.script("prefill", error=(400, body))
    resp = request(w.proxy.url, "/v1/completions", dict(BODY, stream=stream))
    assert (resp.status, resp.read()) == (400, body)
    assert [s[0] for s in w.servers()] == ["p"]  # no decode call
    w.reset()
    w.script("decode", error=(503, b'{"error": "overloaded"}'))
    resp = request(w.proxy.url, "/v1/completions", dict(BODY, stream=stream))
    assert (resp.status, resp.read()) == (503, b'{"error": "overloaded"}')
    assert [s[0] for s in w.servers()] == ["p", "d"]


def test_a_silent_prefill_server_gives_504(w: World) -> None:
    w.script("prefill", stall=threading.Event())
    resp = request(w.proxy.url, "/v1/completions", BODY)
    error = json.loads(resp.read())["error"]
    assert resp.status == 504 and "prefill" in error["message"] and "timed out" in error["message"]
    assert [s[0] for s in w.servers()] == ["p"]


def test_prefill_answer_that_is_not_json_gives_502(w: World) -> None:
    w.script("prefill", error=(200, b"<html>not json</html>"))
    resp = request(w.proxy.url, "/v1/completions", BODY)
    assert resp.status == 502 and "JSON" in json.loads(resp.read())["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"prompt": "x", "stream": "yes"}', b"\xff\xfe"])
def test_bad_client_bodies_are_refused_before_any_call(w: World, raw: bytes) -> None:
    resp = request(w.proxy.url, "/v1/completions", raw)
    assert resp.status == 400 and json.loads(resp.read())["error"]["type"] == "invalid_request_error"
    assert w.calls == []


def test_balancing_rotates_and_avoids_a_busy_decode_server(w: World) -> None:
    for _ in range(4):
        assert request(w.proxy.url, "/v1/completions", BODY).read()
    p, d = w.servers()[0::2], w.servers()[1::2]
    assert p[0] != p[1] and p[:2] == p[2:] and d[0] != d[1] and d[:2] == d[2:]  # each in turn
    w.reset()
    gate = threading.Event()
    w.script("decode", gates={1: gate})  # the first stream stays open
    held = events(request(w.proxy.url, "/v1/completions", dict(BODY, stream=True)))
    next(held)
    for _ in range(2):  # one decode server has a stream in flight, the other none
        assert request(w.proxy.url, "/v1/completions", BODY).read()
    gate.set()
    assert list(held)[-1] == "[DONE]"
    busy, *others = [s for s in w.servers() if s.startswith("d")]
    assert len(others) == 2 and busy not in others and others[0] == others[1]


def test_models_and_health(w: World) -> None:
    resp = request(w.proxy.url, "/v1/models", None, method="GET")
    assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] in ("d0", "d1")
    resp = request(w.proxy.url, "/health", None, method="GET")
    report = json.loads(resp.read())
    assert resp.status == 200 and set(report["decode"].values()) == {"ok"} and len(report["prefill"]) == 2


def test_an_unreachable_prefill_server_gives_502(proxy_python: str) -> None:
    calls: list[Call] = []
    decode = FakeVllm("d", calls)
    dead = FakeVllm("gone", calls)
    dead_url = dead.url
    dead.close()  # nothing listens on its port now
    try:
        with ProxyProcess(proxy_python, [dead_url], [decode.url], TIMEOUTS) as proxy:
            resp = request(proxy.url, "/v1/completions", BODY)
            error = json.loads(resp.read())["error"]
            assert resp.status == 502 and error["type"] == "upstream_unreachable"
            assert dead_url in error["message"] and calls == []
            resp = request(proxy.url, "/health", None, method="GET")
            report = json.loads(resp.read())
            assert resp.status == 503 and report["prefill"][dead_url].startswith("unreachable")
            assert report["decode"] == {decode.url: "ok"}
    finally:
        decode.close()


def test_sigterm_lets_a_stream_in_flight_finish(proxy_python: str) -> None:
    calls: list[Call] = []
    prefill, decode = FakeVllm("p", calls), FakeVllm("d", calls)
    gate = threading.Event()
    decode.script.gates = {1: gate}
    try:
        proxy = ProxyProcess(
            proxy_python, [prefill.url], [decode.url], [*TIMEOUTS, "--shutdown-timeout", "30"]
        )
        got = events(request(proxy.url, "/v1/completions", dict(BODY, stream=True)))
        assert json.loads(next(got))["choices"][0]["text"] == "d-0"
        proxy.proc.terminate()
        proxy.wait_for("stopping: finishing requests in flight", 30)
        gate.set()
        assert list(got)[-1] == "[DONE]"
        assert proxy.proc.wait(timeout=60) == 0
    finally:
        gate.set()
        prefill.close()
        decode.close()
