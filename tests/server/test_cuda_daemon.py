"""The daemon's CUDA path end to end: GPU KV caches shared over CUDA IPC with a real daemon
process, stored, wiped and retrieved byte-exact. Skipped without a GPU (``scripts/gpu_check.sh``
runs them where one exists)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcache import reference
from kvcache.client import KVCacheClient
from kvcache.context import CacheContext
from kvcache.layouts import KVCaches, KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

pytestmark = pytest.mark.cuda

CS, BS, NB = 16, 4, 32  # matches BASE_ARGS' chunk size
FORMATS = [KVFormat.NL_X_TWO_NB_BS_NH_HS, KVFormat.NL_X_NB_TWO_BS_NH_HS, KVFormat.NL_X_NB_BS_HS]


def _caches(fmt: KVFormat, seed: int) -> KVCaches:
    return make_kv_caches(fmt, num_layers=2, num_blocks=NB, block_size=BS, head_size=16,
                          device="cuda", seed=seed)  # fmt: skip


def _blocks(kv: KVCaches, fmt: KVFormat, ids: list[int]) -> torch.Tensor:
    shape = CacheContext(kv, chunk_size=CS, fmt=fmt).shape
    return reference.gather(kv, fmt, shape, ids).view(torch.uint8).cpu()


def _wipe(kv: KVCaches) -> None:
    for layer in kv:
        assert isinstance(layer, torch.Tensor)
        layer.zero_()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gpu_blocks_round_trip_through_the_daemon(
    start_daemon: Callable[..., DaemonProcess], fmt: KVFormat
) -> None:
    daemon = start_daemon()
    kv = _caches(fmt, seed=1)
    tokens = list(range(4 * CS))
    ids = [5, 9, 2, 17, 30, 1, 0, 8, 11, 12, 13, 14, 20, 21, 22, 23]  # scattered
    want = _blocks(kv, fmt, ids)
    with KVCacheClient(daemon.endpoint, 1, "cuda-e2e", timeout_s=30) as c:
        c.register_kv_caches(kv)
        assert c.store(tokens, ids).stored_tokens == len(tokens)
        _wipe(kv)
        assert c.retrieve(tokens, ids) == len(tokens)
        assert torch.equal(_blocks(kv, fmt, ids), want)


def test_a_store_sees_what_the_engine_stream_wrote_just_before(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """The engine writes its KV on its own stream and stores at once, without synchronizing:
    the interprocess event the client records must order the daemon's copy after the write
    (the daemon hands it to the copy, whose stream waits for it on the device)."""
    daemon = start_daemon()
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    kv = _caches(fmt, seed=2)
    tokens = list(range(1000, 1000 + 2 * CS))
    ids = list(range(8))
    with KVCacheClient(daemon.endpoint, 2, "cuda-order", timeout_s=30) as c:
        c.register_kv_caches(kv)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # keep the stream busy, then write: all asynchronous
        for layer in kv:
            assert isinstance(layer, torch.Tensor)
            layer.fill_(7)
        c.store(tokens, ids)
        want = _blocks(kv, fmt, ids)  # synchronizes: the written values
        _wipe(kv)
        assert c.retrieve(tokens, ids) == len(tokens)
        assert torch.equal(_blocks(kv, fmt, ids), want)
        assert bool((_blocks(kv, fmt, ids) != 0).any())


def test_two_gpu_engines_never_see_each_others_bytes(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon()
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    a_kv, b_kv = _caches(fmt, seed=3), _caches(fmt, seed=4)
    tokens, ids = list(range(2 * CS)), list(range(8))
    with KVCacheClient(daemon.endpoint, model_name="m-a", timeout_s=30) as a, \
            KVCacheClient(daemon.endpoint, model_name="m-b", timeout_s=30) as b:  # fmt: skip
        a.register_kv_caches(a_kv)
        b.register_kv_caches(b_kv)
        want_a = _blocks(a_kv, fmt, ids)
        a.store(tokens, ids)
        assert b.lookup(tokens) == 0  # another model: other keys
        _wipe(a_kv)
        assert a.retrieve(tokens, ids) == len(tokens)
        assert torch.equal(_blocks(a_kv, fmt, ids), want_a)
