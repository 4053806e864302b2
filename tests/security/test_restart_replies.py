"""A daemon restart with calls in flight never hands one call the reply of another.

The client keeps many calls in flight on one socket and matches replies by envelope id
(``protocol.channel``, ``client.pipeline``); a daemon that dies (SIGKILL) or stops (SIGTERM:
in-flight calls drained, new ones refused) between a request and its reply, and a successor
that comes up on the same socket and the same disk tier, are the moments a reply could meet
the wrong call: ids reused by a fresh socket, a late reply read after the reconnect, a
re-registration's retry. Each prompt here has its own length, so a retrieve answered with
another prompt's reply shows as the wrong token count. Tried against the landed client: the
door was found closed (ids never repeat within a client, and a socket makes one connection);
this keeps it so.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import KvcacheError
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

BS, CS = 4, 16  # chunk size 16 is the suite's (conftest BASE_ARGS)
PROMPTS = {k: [10_000 * k + t for t in range(k * CS)] for k in (1, 2, 3, 4)}  # k chunks each
BLOCKS = {k: list(range(k * CS // BS)) for k in PROMPTS}


def _cache() -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=BS, num_heads=2, head_size=8, dtype=torch.float16, seed=9)  # fmt: skip
    assert isinstance(kv, list)
    return to_shared(kv)


def _drained(c: KVCacheClient, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(t["inflight"]["store"] == 0 for t in c.status()["engine"]["l2"]):
        assert time.monotonic() < deadline, "L2 writes did not drain"
        time.sleep(0.01)


def _check(calls: list[tuple[int, Future[int]]]) -> int:
    """Every call got its own prompt's answer or an error, never another's; the answers."""
    answered = 0
    for k, future in calls:
        try:
            got = future.result(60)
        except KvcacheError:
            continue  # lost with the daemon, refused while it stopped, or failed fast
        assert got == k * CS, f"a retrieve of {k} chunks got {got} tokens: another call's reply"
        answered += 1
    return answered


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_calls_in_flight_across_a_restart_get_their_own_replies(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, how: signal.Signals
) -> None:
    args = ["--l2-disk-path", str(tmp_path / "tier"), "--l2-disk-size-gb", "0.05"]
    first = start_daemon(*args)
    with KVCacheClient(first.endpoint, 1, "m", timeout_s=10) as c:
        c.register_kv_caches(_cache())
        for k, prompt in PROMPTS.items():
            assert c.store(prompt, BLOCKS[k]).stored_chunks == k
        _drained(c)
        before = [(k, c.retrieve_async(PROMPTS[k], BLOCKS[k])) for k in [1, 2, 3, 4] * 50]
        first.stop(how)  # with calls in flight
        start_daemon(*args, runtime_dir=first.runtime_dir)  # same socket, same disk tier
        _check(before)
        after: list[tuple[int, Future[int]]] = []
        deadline = time.monotonic() + 60
        while _check(after[-40:]) == 0:  # until the client is back (breaker, re-registration)
            assert time.monotonic() < deadline, "no call answered after the restart"
            after += [(k, c.retrieve_async(PROMPTS[k], BLOCKS[k])) for k in [4, 3, 2, 1] * 10]
        assert _check(after) >= 1
