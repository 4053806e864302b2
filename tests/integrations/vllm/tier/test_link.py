"""The tier's daemon link against a real daemon (no vLLM needed): rows in, rows out, byte for
byte; tenants, scopes and row sizes apart; no daemon is an error, never a wait."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.errors import DaemonUnavailableError
from kvcache.integrations.vllm.tier import link as link_module
from kvcache.integrations.vllm.tier.config import TierConfig
from kvcache.integrations.vllm.tier.link import DaemonLink, page_keys
from kvcache.server.launch import DaemonProcess
from tests.helpers import daemon_starter

ROW = 8192
pytestmark = pytest.mark.slow


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    yield from daemon_starter(["--l1-size-gb", "0.1"])


@pytest.fixture
def links() -> Iterator[list[DaemonLink]]:
    made: list[DaemonLink] = []
    yield made
    for link in made:
        link.close()


def connect(
    links: list[DaemonLink], endpoint: str, row: int = ROW, model: str = "vllm-tier:m#1", **kw: object
) -> DaemonLink:
    link = DaemonLink(TierConfig(endpoint=endpoint, staging_chunks=2, **kw), row, model)
    links.append(link)
    link.connect()
    assert link.connected.wait(30)
    return link


def rows(n: int, seed: int, row: int = ROW) -> np.ndarray:
    return np.random.default_rng(seed).integers(-128, 128, (n, row), dtype=np.int8)


def keys(label: str, n: int) -> list[bytes]:
    return [f"{label}:{i}".encode().ljust(36, b"\0") for i in range(n)]


def test_rows_round_trip_byte_for_byte(
    start_daemon: Callable[..., DaemonProcess], links: list[DaemonLink]
) -> None:
    d = start_daemon()
    a, b = connect(links, d.endpoint), connect(links, d.endpoint)  # two instances, one scope
    src, ks = rows(4, 1), keys("rt", 2)
    assert a.store(src, [3, 1], ks) == 2
    assert a.store(src, [3, 1], ks) == 2  # held already: skipped, still held
    assert b.leading_held(ks + keys("absent", 1)) == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(link_module, "LOOKUP_KEYS", 1)  # one key a round trip: the run adds up
        assert b.leading_held(ks + keys("absent", 1) + ks) == 2
    dst = np.zeros_like(src)
    assert b.load(dst, [0, 2], ks) == 2
    assert np.array_equal(dst[[0, 2]], src[[3, 1]]) and not dst[[1, 3]].any()
    dst[:] = 0
    assert b.load(dst, [0, 1], [ks[0], *keys("absent", 1)]) == 1  # the leading run only
    assert np.array_equal(dst[0], src[3]) and not dst[1].any()


def test_tenants_scopes_and_row_sizes_are_apart(
    start_daemon: Callable[..., DaemonProcess], links: list[DaemonLink]
) -> None:
    d = start_daemon()
    src, ks = rows(2, 2), keys("apart", 2)
    assert connect(links, d.endpoint, cache_salt="team-a").store(src, [0, 1], ks) == 2
    assert connect(links, d.endpoint, cache_salt="team-a").leading_held(ks) == 2  # the control
    for other in (
        connect(links, d.endpoint, cache_salt="team-b"),
        connect(links, d.endpoint, cache_salt="team-a", model="vllm-tier:m#2"),
        connect(links, d.endpoint, cache_salt="team-a", row=2 * ROW),
    ):
        assert other.leading_held(ks) == 0
        dst = np.zeros((2, other.row_bytes), np.int8)
        assert other.load(dst, [0, 1], ks) == 0 and not dst.any()


def test_page_keys_are_32_bytes_and_distinct() -> None:
    packed = page_keys([b"a" * 36, b"b" * 36, b"a" * 32])
    assert len(packed) == 96 and len({packed[i : i + 32] for i in range(0, 96, 32)}) == 3


def test_no_daemon_fails_calls_without_waiting(tmp_path: object, links: list[DaemonLink]) -> None:
    link = DaemonLink(TierConfig(endpoint=f"ipc://{tmp_path}/none.sock", timeout_s=1.0), ROW, "vllm-tier:m#1")
    links.append(link)
    with pytest.raises(DaemonUnavailableError):
        link.store(rows(1, 3), [0], keys("x", 1))
    with pytest.raises(DaemonUnavailableError):
        link.leading_held(keys("x", 1))
    assert not link.connected.wait(3)  # registration runs on its own thread, and fails there


def metric(url: str, name: str, model: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model_name="{model}"' in line)  # fmt: skip


def test_the_daemons_metrics_count_the_tiers_pages(
    start_daemon: Callable[..., DaemonProcess], links: list[DaemonLink]
) -> None:
    """The tier's pages go through the daemon's own store/retrieve paths: its metrics, under the
    tier's scoped model name, count them as they count the connector's chunks."""
    d = start_daemon("--metrics-sample-rate", "1.0")
    link = connect(links, d.endpoint, model="vllm-tier:metrics#1")
    src, ks = rows(2, 4), keys("metrics", 2)
    with pytest.raises(ValueError, match="staging_chunks"):
        link.store(rows(3, 4), [0, 1, 2], keys("metrics", 3))  # past one staging half: refused
    assert link.store(src, [0, 1], ks) == 2
    assert link.load(np.zeros_like(src), [0, 1], ks) == 2
    wait = threading.Event()
    for _ in range(100):  # the bus dispatches on its own thread
        if metric(d.metrics_url, "kvcache_retrieve_retrieved_tokens_total", link.model_name) == 2:
            break
        wait.wait(0.1)
    assert metric(d.metrics_url, "kvcache_store_stored_chunks_total", link.model_name) == 2
    assert metric(d.metrics_url, "kvcache_retrieve_retrieved_tokens_total", link.model_name) == 2


def test_a_restarted_daemon_is_registered_with_again(
    start_daemon: Callable[..., DaemonProcess], links: list[DaemonLink], tmp_path: Path
) -> None:
    run = str(tmp_path / "run")
    first = start_daemon(runtime_dir=run)
    link = connect(links, first.endpoint, timeout_s=1.0)
    src, ks = rows(2, 5), keys("restart", 2)
    assert link.store(src, [0, 1], ks) == 2
    first.kill()
    with pytest.raises(DaemonUnavailableError):
        link.store(src, [0, 1], ks)  # times out: the breaker opens
    second = start_daemon(runtime_dir=run)
    assert second.endpoint == first.endpoint
    stored, wait = 0, threading.Event()
    for _ in range(100):  # fails at once until the breaker's probe hears the new daemon
        try:
            stored = link.store(src, [0, 1], ks)
            break
        except DaemonUnavailableError:
            wait.wait(0.1)
    assert stored == 2  # re-registered: the new daemon (empty L1) stored both
    dst = np.zeros_like(src)
    assert link.load(dst, [0, 1], ks) == 2 and np.array_equal(dst, src)
