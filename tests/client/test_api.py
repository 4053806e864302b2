"""KVCacheClient's data API against a real daemon process: sync and future forms, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvcache.client import KVCacheClient
from kvcache.errors import BlockIdError, LayoutError
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches
from tests.client.helpers import BLOCKS, TOKENS, shared_cache


def test_sync_calls_round_trip(daemon: DaemonProcess) -> None:
    kv = shared_cache(1)
    expected = clone_caches(kv)
    with KVCacheClient(daemon.endpoint, 1, "sync-model", timeout_s=5) as c:
        reg = c.register_kv_caches(kv)
        assert (reg.num_layers, reg.num_blocks, reg.block_size, reg.chunk_size) == (2, 32, 4, 16)
        assert reg.fmt == "NL_X_TWO_NB_BS_NH_HS"
        assert c.lookup(TOKENS) == 0
        r = c.store(TOKENS, BLOCKS, request_id="r1")
        assert (r.stored_chunks, r.skipped_chunks, r.stored_tokens) == (8, 0, 128)
        assert c.store(TOKENS, BLOCKS).skipped_chunks == 8
        assert c.lookup(TOKENS + [7] * 5) == 128
        assert c.lookup(TOKENS, cache_salt="other") == 0
        for t in kv:
            t[:, 8:].zero_()
        assert c.retrieve(TOKENS, BLOCKS, skip_tokens=32) == 128  # blocks 0-7 left alone
        assert caches_equal(kv, expected)
        with pytest.raises(BlockIdError):
            c.retrieve(TOKENS, [99] * 32)
        c.end_session("r1")
        assert c.ping() is True
        status = c.status()
        assert 1 in status["instances"] and status["engine"]["chunk_size"] == 16
    with KVCacheClient(daemon.endpoint, 2, "observer", timeout_s=5) as other:
        assert 1 not in other.status()["instances"]  # close() unregistered


def test_future_forms_overlap_and_resolve(daemon: DaemonProcess) -> None:
    kv = shared_cache(2)
    expected = clone_caches(kv)
    with KVCacheClient(daemon.endpoint, 3, "async-model", timeout_s=5) as c:
        c.register_kv_caches(kv)
        prompts = [[p * 1000 + i for i in range(32)] for p in range(8)]
        futures = [c.store_async(p, BLOCKS[i * 4 : i * 4 + 8][:8]) for i, p in enumerate(prompts[:4])]
        stored = [f.result(timeout=10) for f in futures]
        assert [r.stored_tokens for r in stored] == [32] * 4
        token_bytes = 2 * 2 * 2 * 8 * 2  # layers x (K, V) x heads x head size x fp16
        # the daemon's copy figures travel with each reply (the engine's one statistics source)
        assert [r.num_bytes for r in stored] == [32 * token_bytes] * 4
        assert all(r.transfer_seconds > 0 for r in stored)
        again = c.store(prompts[0], BLOCKS[:8])
        assert (again.skipped_chunks, again.num_bytes, again.transfer_seconds) == (2, 0, 0.0)
        reply = c.retrieve_reply_async(prompts[0], BLOCKS[:8], skip_tokens=4).result(timeout=10)
        assert (reply.retrieved_tokens, reply.num_bytes) == (32, 28 * token_bytes)
        assert reply.transfer_seconds > 0
        for t in kv:
            t.zero_()
        got = [c.retrieve_async(p, BLOCKS[i * 4 : i * 4 + 8]) for i, p in enumerate(prompts[:4])]
        assert [f.result(timeout=10) for f in got] == [32] * 4
        # blocks 0..19 were written by overlapping prompts; the last writer of each wins
        assert caches_equal([t[:, 12:20] for t in kv], [t[:, 12:20] for t in expected])  # type: ignore[call-overload]
        bad = c.retrieve_async(prompts[0], [1000] * 8)
        with pytest.raises(BlockIdError):
            bad.result(timeout=10)


def test_threads_share_one_client(daemon: DaemonProcess) -> None:
    kv = shared_cache(3)
    with KVCacheClient(daemon.endpoint, 4, "threads", timeout_s=5) as c:
        c.register_kv_caches(kv)
        c.store(TOKENS, BLOCKS)
        errors: list[BaseException] = []
        hits: list[int] = []

        def work() -> None:
            try:
                hits.extend(c.lookup(TOKENS[: 16 * (1 + i % 8)]) for i in range(50))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(hits) == 200
        assert sorted(set(hits)) == [16 * k for k in range(1, 9)]


def test_cpu_tensor_outside_shared_memory_is_refused() -> None:
    c = KVCacheClient("tcp://127.0.0.1:1", 7, "m", timeout_s=0.2)
    try:
        with pytest.raises(LayoutError, match="empty_shared"):
            c.register_kv_caches([torch.zeros(2, 4, 4, 2, 8)])
        with pytest.raises(LayoutError, match="list of tensors"):
            c.register_kv_caches([1, 2])
    finally:
        c.close()
