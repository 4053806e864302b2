"""A hostile decode client (``Retrieve.await_chunks``) against one real daemon with an L2 tier.

The wait a prefill/decode split asks for is the client's to choose: any client may name chunks
that will never arrive and ask the daemon to wait for them up to its bound
(``retrieve_wait_timeout_s``). That must delay only its own reply: every other client's
retrieve, whether its chunks are in L1 or must come up from L2, is served at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, make_kv_caches
from tests.helpers import daemon_starter

from .conftest import BASE_ARGS

TOKENS, BLOCKS = list(range(128)), list(range(32))  # 8 chunks of 16 tokens, 4 blocks each
LONG_MS = 20_000  # a hostile wait: far longer than any honest reply may take


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    disk = Path(tmp_path_factory.mktemp("l2")) / "tier"
    starter = daemon_starter(BASE_ARGS)
    start = next(starter)
    yield start("--l2-disk-path", str(disk), "--l2-disk-size-gb", "0.1")
    next(starter, None)


def _client(d: DaemonProcess, iid: int, seed: int) -> tuple[KVCacheClient, list[torch.Tensor]]:
    client = KVCacheClient(d.ipc_endpoint, iid, "m", timeout_s=30)
    kv = _cache(seed)
    client.register_kv_caches(kv)
    return client, kv


def test_a_wait_for_chunks_that_never_come_does_not_hold_back_other_retrieves(daemon: DaemonProcess) -> None:
    """The hostile client's wait sits on the daemon's retrieve waiter for its whole bound;
    an honest retrieve that needs that waiter (part of its prompt is cached, the rest may be
    in L2) must not queue behind it."""
    hostile, _ = _client(daemon, 11, 1)
    honest, kv = _client(daemon, 12, 2)
    with hostile, honest:
        mine = [t + 100 for t in TOKENS]
        assert honest.store(mine[:64], BLOCKS[:16]).stored_chunks == 4
        never = [t + 900 for t in TOKENS]  # nobody stores these
        waits = [hostile.retrieve_reply_async(never, BLOCKS, awaited=(8, LONG_MS)) for _ in range(2)]
        time.sleep(0.3)  # the waits are on the waiter now
        assert not any(w.done() for w in waits)
        start = time.monotonic()
        into = BLOCKS[16:] + BLOCKS[:16]  # the cached half lands in blocks 16..31
        got = honest.retrieve_reply_async(mine, into).result(timeout=30)
        took = time.monotonic() - start
        assert got.retrieved_tokens == 64
        assert took < 2.0, f"an honest retrieve waited {took:.1f} s behind another client's wait"
        assert not any(w.done() for w in waits)  # the hostile waits still run to their bound
        assert caches_equal([t[:, 16:] for t in kv], [t[:, :16] for t in kv])
        assert daemon.proc.poll() is None
