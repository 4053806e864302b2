"""Prefill/decode disaggregation through kvcache, end to end: real ``vllm serve`` processes
(a ``kv_producer`` prefill instance, a ``kv_consumer`` decode instance on the same daemon, and
a second ``kv_consumer`` on another daemon, as on another host), two real daemons sharing a
real 3 + 3 Redis Cluster L2, and kvcache's proxy. The first test drives the two halves
itself, as the proxy does (vLLM's P/D convention), so that it can look between them; one
test goes through the proxy; one splits across the two daemons, where the decode side's wait
covers the prefill daemon's write-through reaching the cluster:

1. the prefill instance gets the request with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}`` and answers with the parameters that
   name the prompt chunks it stored (asynchronously: they may still be in flight);
2. the decode instance gets the original request with those parameters, waits at the daemon
   for exactly those chunks, and generates.

For prompts of odd lengths: the decode output equals that of the same decode instance, its
prefix cache reset, serving the request without parameters (loading the prefix from kvcache
through an ordinary lookup); the decode instance computed less than one vLLM block of the
prompt (vLLM's ``prompt_tokens_by_source``): the prefill instance stored the prompt's whole
blocks past its last whole chunk as a tail chunk only the parameters' holder can find, and
the ordinary lookup indeed does not find it (it computes the whole tail); nothing the decode
instance waited for went missing (its metrics and the daemon's).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcache.integrations.vllm.disagg import PARAMS_KEY
from kvcache.integrations.vllm.proxy.launch import ProxyProcess
from tests.helpers import sealed_redis_args, start_cluster
from tests.integrations.vllm.proxy.test_proxy import events, request
from tests.integrations.vllm.test_connector import ScrapedDaemon, start_daemon
from tests.integrations.vllm.vllm_driver import prompts
from tests.integrations.vllm.vllm_server import (
    BLOCK,
    Server,
    make_model,
    post,
    reset_prefix_cache,
    scrape,
    start_server,
    total,
)

pytestmark = pytest.mark.slow
CHUNK = 256
WAIT_S = 5.0  # transfer_wait_s: what a fault costs the decode side
LENGTHS = (300, 555, 640, 777)  # a tail of 1, 1, 4 and 0 whole blocks after the whole chunks


@dataclass
class Split:
    prefill: Server
    decode: Server
    daemon: ScrapedDaemon
    remote_decode: Server
    """A ``kv_consumer`` on ``remote_daemon``: the split across hosts."""
    remote_daemon: ScrapedDaemon
    proxy: ProxyProcess
    model: str
    tmp: Path
    daemon_args: list[str]


@pytest.fixture(scope="module")
def split(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("disagg")
    model = tmp / "model"
    make_model(vllm_python, model)
    cluster = start_cluster()
    remote = tmp / "remote"
    remote.mkdir()
    args = ["--chunk-size", str(CHUNK), "--l2-redis-url", cluster.url, *sealed_redis_args(tmp)]
    daemons: list[ScrapedDaemon] = []
    servers: list[Server] = []
    proxy: ProxyProcess | None = None
    try:
        daemons.append(start_daemon(tmp, None, "daemon", args))
        daemons.append(start_daemon(remote, None, "remote-daemon", args))
        extra = {"timeout_s": 30.0, "transfer_wait_s": WAIT_S}
        roles = [("prefill", "kv_producer", tmp), ("decode", "kv_consumer", tmp),
                 ("remote-decode", "kv_consumer", remote)]  # fmt: skip
        for name, role, host in roles:
            run = host / "run"
            servers.append(start_server(vllm_python, model, run, tmp / f"{name}.log", role, extra))
        started = max(server.wait_ready() for server in servers)
        print(f"three vllm serve processes ready in {started:.0f} s")
        prefill, decode, remote_decode = servers
        proxy = ProxyProcess(vllm_python, [prefill.base], [decode.base])
        box = Split(prefill, decode, daemons[0], remote_decode, daemons[1], proxy, str(model), tmp, args)
        yield box
        daemons = [box.daemon, box.remote_daemon]  # the first may have been restarted
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop()
            print(server.log.read_text()[-2000:])
        for daemon in daemons:
            daemon.stop()
        cluster.close()


def _computed(base: str, want_prompt_tokens: float) -> dict[str, float]:
    """The decode instance's metrics once vLLM logged ``want_prompt_tokens`` prompt tokens
    (its logger records outputs after the response is sent: polled, it has no event)."""
    deadline = time.monotonic() + 60
    while True:
        samples = scrape(base + "/metrics")
        if total(samples, "vllm:prompt_tokens_by_source_total") >= want_prompt_tokens:
            return samples
        assert time.monotonic() < deadline, "vLLM never counted the request's prompt tokens"
        time.sleep(0.1)


def _local_compute(samples: dict[str, float]) -> float:
    return total(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")


def test_decode_generates_from_what_prefill_stored(split: Split) -> None:
    decode_base = split.decode.base
    seen = total(scrape(decode_base + "/metrics"), "vllm:prompt_tokens_by_source_total")
    for i, length in enumerate(LENGTHS):
        prompt = prompts(100 + i, length, 1, 0)[0]
        assert len(prompt) == length
        request = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        # 1. prefill: one token, the parameters back.
        asked = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        first = post(split.prefill.base + "/v1/completions", asked)
        params = first["kv_transfer_params"]
        whole = length // CHUNK * CHUNK
        tail = (length - whole) // BLOCK * BLOCK
        ours = params[PARAMS_KEY]
        assert params["do_remote_prefill"] is True and (ours["v"], ours["tokens"]) == (1, whole)
        assert ours.get("tail", 0) == tail and len(ours.get("secret", "")) == (32 if tail else 0)
        # 2. decode, with them: right after the prefill answered (its stores may be in flight).
        before = scrape(decode_base + "/metrics")
        split_out = post(decode_base + "/v1/completions", {**request, "kv_transfer_params": params})
        seen += length
        after = _computed(decode_base, seen)
        computed = _local_compute(after) - _local_compute(before)
        assert computed == length - min(whole + tail, length - 1) <= BLOCK, (length, computed)
        assert total(after, "vllm:kvcache_transfer_missed_tokens_total") == 0
        # 3. the reference: the same instance, its own prefix cache reset, without parameters:
        # an ordinary lookup loads the same prefix from kvcache, and never finds the tail.
        reset_prefix_cache(decode_base)
        reference = post(decode_base + "/v1/completions", request)
        seen += length
        computed = _local_compute(_computed(decode_base, seen)) - _local_compute(after)
        assert computed == length - min(whole, length - 1), (length, computed)
        reset_prefix_cache(decode_base)
        assert split_out["choices"][0]["text"] == reference["choices"][0]["text"], length
    final = scrape(decode_base + "/metrics")
    awaited = sum(n // BLOCK * BLOCK for n in LENGTHS)
    assert total(final, "vllm:kvcache_transfer_requests_total") == len(LENGTHS)
    assert total(final, "vllm:kvcache_transfer_awaited_tokens_total") == awaited
    assert split.daemon.metric("kvcache_retrieve_awaited_missing_tokens_total") == 0
    # The prefill instance never loads and the decode instance never stores.
    assert total(scrape(split.prefill.base + "/metrics"), "vllm:kvcache_lookup_tokens_total") == 0
    assert total(final, "vllm:kvcache_stored_tokens_total") == 0


def test_a_decode_request_its_own_prefix_cache_already_covers(split: Split) -> None:
    """The same request with the same transfer parameters, twice on the decode instance: the
    second time vLLM's own prefix cache holds every token the parameters name (777 tokens:
    the three whole chunks, 768, which vLLM's own hit covers), so there is nothing to wait
    for at the daemon. It is served from vLLM's cache like any request,
    with the first one's output. (Before: the connector still answered vLLM "0 tokens, loaded
    asynchronously", which vLLM 0.32 asserts against, and the decode engine died.)"""
    decode_base = split.decode.base
    prompt = prompts(150, 777, 1, 0)[0]
    request = {"model": split.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    asked = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = post(split.prefill.base + "/v1/completions", asked)["kv_transfer_params"]
    first = post(decode_base + "/v1/completions", {**request, "kv_transfer_params": params})
    again = post(decode_base + "/v1/completions", {**request, "kv_transfer_params": params})
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    reset_prefix_cache(decode_base)


def test_through_the_proxy_whole_and_streamed(split: Split) -> None:
    """A client of the proxy gets, whole and streamed, what the decode instance answers on its
    own, and the decode instance computed at most one block of each prompt."""
    decode_base = split.decode.base
    seen = total(scrape(decode_base + "/metrics"), "vllm:prompt_tokens_by_source_total")
    for i, (length, stream) in enumerate(((555, False), (777, True))):
        prompt = prompts(300 + i, length, 1, 0)[0]
        body = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        before = scrape(decode_base + "/metrics")
        resp = request(split.proxy.url, "/v1/completions", {**body, "stream": stream})
        assert resp.status == 200
        if stream:
            chunks = [json.loads(e) for e in events(resp) if e != "[DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            text = json.loads(resp.read())["choices"][0]["text"]
        seen += length
        computed = _local_compute(_computed(decode_base, seen)) - _local_compute(before)
        assert computed <= BLOCK, (length, computed)
        reset_prefix_cache(decode_base)
        reference = post(decode_base + "/v1/completions", body)
        seen += length
        _computed(decode_base, seen)
        reset_prefix_cache(decode_base)
        assert text == reference["choices"][0]["text"], length


def test_split_across_two_daemons_sharing_a_redis_cluster(split: Split) -> None:
    """Across hosts: the prefill instance stores through its daemon; a decode instance on
    another daemon (they share only the Redis Cluster) gets the parameters the moment the
    prefill answered, waits at its own daemon until the prefill daemon's write-through has
    reached the cluster (a waiting retrieve polls L2), and computes at most one block. Its
    text equals its own without parameters (an ordinary lookup, served from L2 too)."""
    remote = split.remote_decode.base
    seen = total(scrape(remote + "/metrics"), "vllm:prompt_tokens_by_source_total")
    from_l2 = split.remote_daemon.metric("kvcache_retrieve_l2_tokens_total")
    awaited = 0
    for i, length in enumerate((555, 777)):
        prompt = prompts(400 + i, length, 1, 0)[0]
        request = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        asked = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params = post(split.prefill.base + "/v1/completions", asked)["kv_transfer_params"]
        whole = length // CHUNK * CHUNK
        tail = (length - whole) // BLOCK * BLOCK
        awaited += whole + tail
        before = scrape(remote + "/metrics")
        out = post(remote + "/v1/completions", {**request, "kv_transfer_params": params})
        seen += length
        computed = _local_compute(_computed(remote, seen)) - _local_compute(before)
        assert computed == length - min(whole + tail, length - 1) <= BLOCK, (length, computed)
        reset_prefix_cache(remote)
        reference = post(remote + "/v1/completions", request)
        seen += length
        _computed(remote, seen)
        reset_prefix_cache(remote)
        assert out["choices"][0]["text"] == reference["choices"][0]["text"], length
    final = scrape(remote + "/metrics")
    assert total(final, "vllm:kvcache_transfer_missed_tokens_total") == 0
    assert split.remote_daemon.metric("kvcache_retrieve_awaited_missing_tokens_total") == 0
    # What the decode side copied came up from L2: its daemon never saw the prefill's stores.
    assert split.remote_daemon.metric("kvcache_retrieve_l2_tokens_total") - from_l2 >= awaited


def _decode_and_reference(split: Split, request: dict[str, object], params: dict[str, object]) -> None:
    """The decode instance serves ``request`` with ``params`` and, its prefix cache reset,
    without: the same text (nothing wrong was served, whatever the parameters named)."""
    out = post(split.decode.base + "/v1/completions", {**request, "kv_transfer_params": params})
    reset_prefix_cache(split.decode.base)
    reference = post(split.decode.base + "/v1/completions", request)
    reset_prefix_cache(split.decode.base)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]


def test_faults_are_recomputed_within_the_bound_and_nothing_wrong_is_served(split: Split) -> None:
    """(1) The prefill instance is gone before its stores reached the daemon: the parameters
    (as it would have answered) name chunks and a tail that never arrive: the decode side
    waits ``transfer_wait_s``, recomputes, counts it, and serves the same text as without
    parameters. (2) The daemon restarts between the two halves, once what the prefill side
    stored was written through: the restarted daemon (empty L1) serves all of it from the
    Redis Cluster, and the decode side computes at most one block. Runs after the main test
    (it restarts the daemon)."""
    decode_metrics = split.decode.base + "/metrics"
    missed = total(scrape(decode_metrics), "vllm:kvcache_transfer_missed_tokens_total")
    daemon_missed = split.daemon.metric("kvcache_retrieve_awaited_missing_tokens_total")
    prompt = prompts(200, 555, 1, 0)[0]
    request = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    ours = {"v": 1, "tokens": 512, "tail": 32, "secret": secrets.token_hex(16)}
    gone = {"do_remote_prefill": True, PARAMS_KEY: ours}
    _decode_and_reference(split, request, gone)
    deadline = time.monotonic() + 60
    while total(scrape(decode_metrics), "vllm:kvcache_transfer_missed_tokens_total") < missed + 544:
        assert time.monotonic() < deadline, "the missed tokens were never counted"
        time.sleep(0.1)  # vLLM's logger: no event to wait on
    assert total(scrape(decode_metrics), "vllm:kvcache_transfer_missed_tokens_total") == missed + 544
    # The daemon counts whole chunks: the tail chunk as one (256 tokens, most of them padding).
    assert split.daemon.metric("kvcache_retrieve_awaited_missing_tokens_total") == daemon_missed + 768

    prompt = prompts(201, 555, 1, 0)[0]
    request = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    asked = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    written = split.daemon.metric("kvcache_l2_store_chunks_total")
    params = post(split.prefill.base + "/v1/completions", asked)["kv_transfer_params"]
    deadline = time.monotonic() + 60
    while split.daemon.metric("kvcache_l2_store_chunks_total") < written + 3:  # 2 chunks, 1 tail
        assert time.monotonic() < deadline, "the prefill's chunks never reached L2"
        time.sleep(0.05)  # the daemon's counter: polled, as a router would
    split.daemon.stop()
    split.daemon = start_daemon(split.tmp, None, "daemon-restarted", split.daemon_args)
    before = scrape(decode_metrics)
    seen = total(before, "vllm:prompt_tokens_by_source_total")
    _decode_and_reference(split, request, params)
    computed = _local_compute(_computed(split.decode.base, seen + 2 * 555)) - _local_compute(before)
    assert computed == (555 - 544) + (555 - 512), computed  # with the parameters, then without
    assert split.daemon.metric("kvcache_retrieve_awaited_missing_tokens_total") == 0


def test_a_prefill_instance_killed_right_after_answering(split: Split) -> None:
    """The prefill process is SIGKILLed the moment it has answered, with whatever of its
    asynchronous stores was still in flight: the decode side serves what arrived, recomputes
    the rest within its bound, and answers as it does without parameters. Runs last: the
    prefill instance stays dead."""
    decode_metrics = split.decode.base + "/metrics"
    missed = total(scrape(decode_metrics), "vllm:kvcache_transfer_missed_tokens_total")
    awaited = total(scrape(decode_metrics), "vllm:kvcache_transfer_awaited_tokens_total")
    prompt = prompts(203, 777, 1, 0)[0]
    request = {"model": split.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    asked = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = post(split.prefill.base + "/v1/completions", asked)["kv_transfer_params"]
    os.killpg(split.prefill.proc.pid, signal.SIGKILL)
    split.prefill.proc.wait(30)
    _decode_and_reference(split, request, params)
    deadline = time.monotonic() + 60
    name = "vllm:kvcache_transfer_awaited_tokens_total"
    while total(after := scrape(decode_metrics), name) < awaited + 768:
        assert time.monotonic() < deadline, "the awaited tokens were never counted"
        time.sleep(0.1)  # vLLM's logger: no event to wait on
    # Every awaited token either arrived or was counted missing and recomputed.
    assert total(after, name) == awaited + 768
    assert 0 <= total(after, "vllm:kvcache_transfer_missed_tokens_total") - missed <= 768
