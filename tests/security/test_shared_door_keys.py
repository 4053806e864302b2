"""Plain loopback TCP (``--tcp`` without keys) is one principal for every local user: its
chunks must never be served to engines on other doors, nor theirs to it.

Observed on main after issue 20: a client on the loopback TCP port that registers an engine
under another engine's model name stores its own bytes for a prompt, and an engine of the
operator on ipc:// then looks the prompt up as a hit and retrieves the planted bytes as its
KV; the other way round, the stranger reads the operator's cached prefixes (lookup, then
retrieve into its own blocks). Chunk keys were scoped by model, salt and chunk shape, never
by who may be behind the door. A stranger registers GPU memory (CUDA IPC) over TCP; this
CPU test hands the stranger's memfds over as the daemon's user would (only that user
reaches the fd socket), which changes nothing about the keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import LimitExceededError
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, make_kv_caches

TOKENS, BLOCKS = list(range(64)), list(range(16))
MODEL = "shared-model"


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def test_a_loopback_stranger_cannot_plant_kv_for_an_engine_on_the_unix_socket(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon(tcp=True)
    with KVCacheClient(d.endpoint, 2, MODEL, timeout_s=10) as stranger:  # loopback TCP
        stranger.register_kv_caches(_cache(66))
        assert stranger.store(TOKENS, BLOCKS).stored_tokens == 64
    victim_kv = to_shared([torch.zeros_like(t) for t in _cache(1)])
    with KVCacheClient(d.ipc_endpoint, 1, MODEL, timeout_s=10) as victim:
        victim.register_kv_caches(victim_kv)
        assert victim.lookup(TOKENS) == 0, "the stranger's chunks are a hit on ipc://"
        assert victim.retrieve(TOKENS, BLOCKS) == 0
    assert all(not t.any() for t in victim_kv)  # no planted byte reached the engine
    assert d.proc.poll() is None


def test_a_loopback_stranger_cannot_read_the_prefixes_of_an_engine_on_the_unix_socket(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon(tcp=True)
    victim_kv = _cache(1)
    with KVCacheClient(d.ipc_endpoint, 1, MODEL, timeout_s=10) as victim:
        victim.register_kv_caches(victim_kv)
        assert victim.store(TOKENS, BLOCKS).stored_tokens == 64
        loot = to_shared([torch.zeros_like(t) for t in victim_kv])
        with KVCacheClient(d.endpoint, 2, MODEL, timeout_s=10) as stranger:  # loopback TCP
            stranger.register_kv_caches(loot)
            assert stranger.lookup(TOKENS) == 0, "the operator's prefix is a hit over loopback TCP"
            assert stranger.retrieve(TOKENS, BLOCKS) == 0
        assert all(not t.any() for t in loot)
        # The operator's engine is still served its own bytes.
        fresh = to_shared([torch.zeros_like(t) for t in victim_kv])
        with KVCacheClient(d.ipc_endpoint, 3, MODEL, timeout_s=10) as reader:
            reader.register_kv_caches(fresh)
            assert reader.retrieve(TOKENS, BLOCKS) == 64 and caches_equal(fresh, victim_kv)
    assert d.proc.poll() is None


def test_a_loopback_stranger_cannot_take_every_instance_slot(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-instances", "2", tcp=True)
    strangers = [KVCacheClient(d.endpoint, 10 + i, MODEL, timeout_s=10) for i in range(3)]
    try:
        for i, stranger in enumerate(strangers):
            try:
                stranger.register_kv_caches(_cache(10 + i))
            except LimitExceededError:
                break  # the stranger is held to its share: as it should be
        with KVCacheClient(d.ipc_endpoint, 1, MODEL, timeout_s=10) as operator_engine:
            operator_engine.register_kv_caches(_cache(1))  # refused while the stranger holds all
            assert operator_engine.store(TOKENS, BLOCKS).stored_tokens == 64
    finally:
        for stranger in strangers:
            stranger.close()
    assert d.proc.poll() is None
