"""The client's session against a real daemon process: heartbeats, the breaker while the daemon
is down, re-registration after a restart, and the send hook tests and tools use."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.client import KVCacheClient, empty_shared
from kvcache.protocol import messages as m
from kvcache.protocol.errors import DaemonUnavailableError
from kvcache.server.launch import DaemonProcess
from kvcache.transport.endpoints import ipc_endpoint
from tests.client.helpers import ARGS, BLOCKS, TOKENS, shared_cache, wait_for


def test_idle_client_stays_registered_through_heartbeats(daemon: DaemonProcess) -> None:
    with KVCacheClient(daemon.endpoint, 5, "idle", timeout_s=5) as c, \
            KVCacheClient(daemon.endpoint, 6, "observer", timeout_s=5) as observer:  # fmt: skip
        c.register_kv_caches(shared_cache(4))
        deadline = time.monotonic() + 3 * 0.6  # three heartbeat timeouts of silence from the caller
        while time.monotonic() < deadline:
            assert 5 in observer.status()["instances"]
            time.sleep(0.05)


def test_daemon_down_fails_within_the_timeout_then_recovers(tmp_path: Path) -> None:
    runtime_dir = str(tmp_path / "run")  # where the daemon will be: nothing listens there yet
    endpoint = ipc_endpoint(runtime_dir)
    c = KVCacheClient(endpoint, 8, "late", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=r"python -m kvcache\.server"):
        c.ping()
    assert 0.45 <= time.monotonic() - start < 1.5
    assert c.breaker.open and c.breaker.trips == 1
    for _ in range(20):  # the breaker is open: each fails at once, unsent (no 20 timeouts)
        with pytest.raises(TimeoutError, match="failing fast"):  # a DaemonUnavailableError
            c.lookup([1, 2, 3])
    assert c.breaker.short_circuited == 20
    c.report_block_allocations([], wait=False)  # a scheduler's notices never block: dropped
    c.end_session("r", wait=False)
    assert c.dropped_notices == 2
    with DaemonProcess(ARGS, runtime_dir=runtime_dir):
        wait_for(lambda: not c.breaker.open, 10, "the background probe to close the breaker")
        c.timeout_s = 5
        assert c.ping() is False  # a fresh socket: no stale replies, not registered yet
        kv = [empty_shared((2, 8, 4, 2, 8), torch.float16) for _ in range(2)]
        c.register_kv_caches(kv)
        assert c.ping() is True
        c.close()


def test_restarted_daemon_gets_the_registration_back_by_itself(tmp_path: Path) -> None:
    runtime_dir = str(tmp_path / "run")  # the same ipc:// endpoint for both daemons
    with DaemonProcess(ARGS, runtime_dir=runtime_dir) as first:
        c = KVCacheClient(first.endpoint, 9, "survivor", timeout_s=5)
        c.register_kv_caches(shared_cache(5))
    with DaemonProcess(ARGS, runtime_dir=runtime_dir) as second, \
            KVCacheClient(second.endpoint, 10, "observer", timeout_s=5) as observer:  # fmt: skip
        # No call on ``c``: its heartbeat notices the new daemon and registers again.
        wait_for(lambda: 9 in observer.status()["instances"], 10, "re-registration")
        c.close()


def test_intercept_sees_each_request_the_breaker_lets_through(daemon: DaemonProcess) -> None:
    """``Session.intercept`` is the seam for delaying or counting requests (the vLLM harness
    gates stores with it): it runs on whichever thread sends, before the daemon sees a byte."""
    with KVCacheClient(daemon.endpoint, 11, "hooked", timeout_s=5) as c:
        c.register_kv_caches(shared_cache(6))
        seen: list[str] = []

        def hook(body: m.RequestBody, send: Any) -> m.ReplyBody:
            seen.append(type(body).__name__)
            return send(body)

        c.session.intercept(hook)
        assert c.store(TOKENS, BLOCKS).stored_tokens == 128
        assert c.store_async(TOKENS, BLOCKS).result(timeout=10).skipped_chunks == 8
        assert c.lookup(TOKENS) == 128
        assert seen == ["Store", "Store", "Lookup"]
        assert c.session.token  # the registration token the hooked requests carried
