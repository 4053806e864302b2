"""The proxy's rules without I/O: configuration checks, the balancer, SSE event boundaries, and
that kvcache's core never imports it (it needs aiohttp, which kvcache does not)."""

from __future__ import annotations

import pytest

from kvcache.errors import ConfigError
from kvcache.integrations.vllm.proxy.routing import Pool, ProxyConfig, split_events, transfer_params
from tests.test_import_graph import import_graph


def test_config_normalises_urls_and_refuses_bad_ones() -> None:
    c = ProxyConfig(prefill=("http://a:1/",), decode=("https://b",))
    assert (c.prefill, c.decode) == (("http://a:1",), ("https://b",))
    bad = [
        {"prefill": (), "decode": ("http://b",)},
        {"prefill": ("ftp://a",), "decode": ("http://b",)},
        {"prefill": ("http://a/v1",), "decode": ("http://b",)},
        {"prefill": ("http://a:99999",), "decode": ("http://b",)},
        {"prefill": ("http://a", "http://a/"), "decode": ("http://b",)},
        {"prefill": ("http://a",), "decode": ("http://b",), "read_s": 0},
    ]
    for kwargs in bad:
        with pytest.raises(ConfigError):
            ProxyConfig(**kwargs)  # type: ignore[arg-type]


def test_pool_takes_the_least_busy_and_rotates_among_equals() -> None:
    pool = Pool.of(["a", "b", "c"])
    picked = []
    for _ in range(4):
        with pool.pick() as u:
            picked.append(u.url)
    assert picked == ["a", "b", "c", "a"]
    with pool.pick() as held:  # b
        with pool.pick() as second:
            assert (held.url, second.url) == ("b", "c")
        with pool.pick() as third:
            assert third.url == "a"
        assert held.in_flight == 1
    assert [u.in_flight for u in pool.upstreams] == [0, 0, 0]


def test_only_whole_events_are_released() -> None:
    assert split_events(b"data: 1\n\ndata: 2\n\ndata: 3") == (b"data: 1\n\ndata: 2\n\n", b"data: 3")
    assert split_events(b"data: 1\r\n\r\ndata: 2") == (b"data: 1\r\n\r\n", b"data: 2")
    assert split_events(b"data: 1\n") == (b"", b"data: 1\n")


def test_prefill_answers_must_be_objects() -> None:
    assert transfer_params(b'{"kv_transfer_params": {"a": [1]}}') == {"a": [1]}
    assert transfer_params(b'{"choices": []}') is None
    for raw in (b"nope", b"[]", b'{"kv_transfer_params": 3}'):
        with pytest.raises(ValueError):
            transfer_params(raw)


def test_the_proxy_stays_outside_kvcache_core() -> None:
    """Only the checkout's benchmarks reach the proxy, and only its standard-library launcher:
    the aiohttp modules are loaded by ``python -m kvcache.integrations.vllm.proxy`` alone."""
    proxy = "kvcache.integrations.vllm.proxy"
    for module, deps in import_graph().items():
        if module.startswith(proxy):
            continue
        reached = {d for d in deps if d.startswith(proxy)}
        assert not reached or (module.startswith("benchmarks.") and reached <= {f"{proxy}.launch"}), module
