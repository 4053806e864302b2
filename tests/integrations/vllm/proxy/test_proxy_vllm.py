"""Smoke: the proxy in front of two real ``vllm serve`` instances with kvcache's connector
(``kv_both``) and one daemon. The answers through the proxy, whole and streamed, are the prefill
server's own greedy answers. The prefill server received the ``max_tokens=1`` call, and the
decode server computed only what kvcache did not give it (its ``/metrics``, against the
daemon's).

Slow, and it needs a built vLLM venv (``KVCACHE_VLLM_PYTHON`` or scripts/vllm_env.sh's).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvcache.bench.disagg_servers import VllmServer, connector_config, total
from kvcache.bench.vllm_messages import ModelSpec
from kvcache.integrations.vllm.proxy.launch import ProxyProcess
from kvcache.server.launch import DaemonProcess
from tests.integrations.vllm.proxy.test_proxy import events, request

pytestmark = pytest.mark.slow
MODEL = ModelSpec(layers=2, hidden=128, heads=4, kv_heads=2)
CHUNK = 256


@pytest.fixture(scope="module")
def split(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, VllmServer, VllmServer]]:
    python = vllm_python
    work = tmp_path_factory.mktemp("pd")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    model = work / "model"
    subprocess.run(
        [
            python,
            "-m",
            "kvcache.bench.vllm_driver",
            "make-model",
            "--dir",
            str(model),
            "--spec",
            msgspec.json.encode(MODEL).decode(),
        ],
        check=True,
        env=env,
        cwd="/",
        timeout=600,
    )
    with DaemonProcess(["--chunk-size", str(CHUNK), "--l1-size-gb", "0.25"]) as daemon:
        env["KVCACHE_RUNTIME_DIR"] = daemon.runtime_dir
        kw = {"block_size": 32, "max_model_len": 4096, "kv_cache_mb": 64}
        servers = [
            VllmServer(name, python, model, env, work, connector_config("kv_both", {"timeout_s": 30.0}), **kw)
            for name in ("prefill", "decode")
        ]
        try:
            for s in servers:
                s.wait_ready(600)
            with ProxyProcess(python, [servers[0].url], [servers[1].url]) as proxy:
                yield proxy, servers[0], servers[1]
        finally:
            for s in servers:
                s.stop()


def test_answers_through_the_proxy_are_the_prefill_servers_own(
    split: tuple[ProxyProcess, VllmServer, VllmServer],
) -> None:
    proxy, prefill, decode = split
    prompt = [3 + (i * 37) % 990 for i in range(2 * CHUNK + 45)]  # two whole chunks and a tail
    body = {"model": "bench", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    direct = json.loads(request(prefill.url, "/v1/completions", body).read())["choices"][0]["text"]
    before = {"prefill": prefill.metrics(), "decode": decode.metrics()}
    resp = request(proxy.url, "/v1/completions", body)
    assert resp.status == 200
    assert json.loads(resp.read())["choices"][0]["text"] == direct
    streamed = [
        json.loads(e)
        for e in events(request(proxy.url, "/v1/completions", dict(body, stream=True)))
        if e != "[DONE]"
    ]
    assert "".join(e["choices"][0]["text"] for e in streamed) == direct and len(streamed) >= 2

    def delta(server: VllmServer, name: str, **labels: str) -> float:
        return total(server.metrics(), name, **labels) - total(before[server.name], name, **labels)

    # vLLM's counters land when its logger records an engine step: scrape until both show.
    deadline = time.monotonic() + 60
    while delta(prefill, "vllm:request_success_total") < 2 or delta(decode, "vllm:request_success_total") < 2:
        assert time.monotonic() < deadline, "the servers never counted the two requests"
        time.sleep(0.2)  # the scrape is the only way to observe vLLM's logger
    assert delta(prefill, "vllm:generation_tokens_total") == 2  # max_tokens=1, twice
    assert delta(decode, "vllm:generation_tokens_total") == 2 * 8
    computed = delta(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    loaded = delta(decode, "vllm:kvcache_loaded_tokens_total")
    print(
        f"decode server, 2 requests of {len(prompt)} prompt tokens: {computed:.0f} computed, "
        f"{loaded:.0f} loaded from kvcache"
    )
