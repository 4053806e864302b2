"""A retrieve that waits for chunks another engine is storing (``await_chunks``: the decode
half of a prefill/decode split), against one real daemon process.

The wait is asked for by the client, so it is hostile input too: it may name more chunks
than the request holds, negative or absurd bounds, or chunks stored under another tenant's
salt or another model. Keys are always derived by the daemon from the caller's own tokens,
salt and registration, so a wait can only delay a read the caller could make anyway: these
tests check that it never widens what is read, that malformed waits get a typed error and
change nothing, and that the wait itself works and is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import ChunkMismatchError
from kvcache.integrations.vllm.disagg import tail_chunk, tail_extra
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from tests.helpers import daemon_starter
from tests.server.helpers import scrape

from .conftest import BASE_ARGS, raw_call

TOKENS, BLOCKS = list(range(128)), list(range(32))  # 8 chunks of 16 tokens, 4 blocks each
HALF = 64
SHORT_MS = 300  # a wait that is meant to run out
SECRET = "5ec7e7" + "0" * 26


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    starter = daemon_starter(BASE_ARGS)
    start = next(starter)
    yield start()
    next(starter, None)


def _pair(d: DaemonProcess, producer_model: str = "m", consumer_model: str = "m") -> tuple[
    KVCacheClient, list[torch.Tensor], KVCacheClient, list[torch.Tensor]
]:  # fmt: skip
    producer = KVCacheClient(d.ipc_endpoint, 1, producer_model, timeout_s=10)
    consumer = KVCacheClient(d.ipc_endpoint, 2, consumer_model, timeout_s=10)
    kv_p, kv_c = _cache(1), _cache(2)
    producer.register_kv_caches(kv_p)
    consumer.register_kv_caches(kv_c)
    return producer, kv_p, consumer, kv_c


def _awaited_missing(d: DaemonProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scrape(d.metrics_url).splitlines()
        if line.startswith("kvcache_retrieve_awaited_missing_tokens_total{")
    )


def test_a_retrieve_waits_for_the_chunks_a_store_in_flight_brings(daemon: DaemonProcess) -> None:
    """The decode side asks before the prefill side's last chunks are in: without the wait it
    would copy the first half and stop (the daemon answers only from READY chunks)."""
    producer, kv_p, consumer, kv_c = _pair(daemon)
    with producer, consumer:
        tokens = [t + 1000 for t in TOKENS]
        assert producer.store(tokens[:HALF], BLOCKS[: HALF // 4]).stored_tokens == HALF
        waiting = consumer.retrieve_reply_async(tokens, BLOCKS, awaited=(8, 8000), request_id="dec")
        assert consumer.ping() and not waiting.done()  # still waiting for the second half
        assert producer.store(tokens, BLOCKS).stored_chunks == 4  # the second half
        assert waiting.result(timeout=10).retrieved_tokens == 128
        assert caches_equal(kv_c, kv_p)


def test_a_chunk_that_never_arrives_ends_the_wait_at_its_bound_and_is_counted(daemon: DaemonProcess) -> None:
    producer, _kv_p, consumer, _kv_c = _pair(daemon)
    with producer, consumer:
        tokens = [t + 2000 for t in TOKENS]
        producer.store(tokens[:HALF], BLOCKS[: HALF // 4])
        before = _awaited_missing(daemon)
        reply = consumer.retrieve_reply_async(tokens, BLOCKS, awaited=(8, SHORT_MS)).result(timeout=10)
        assert reply.retrieved_tokens == HALF  # what did arrive is served; the rest is recomputed
        deadline_metric = before + (128 - HALF)
        for _ in range(200):
            if _awaited_missing(daemon) >= deadline_metric:
                break
            consumer.ping()
        assert _awaited_missing(daemon) == deadline_metric


@pytest.mark.parametrize("other", ["salt", "model"])
def test_a_wait_never_reads_another_tenants_or_models_chunks(daemon: DaemonProcess, other: str) -> None:
    """Transfer parameters carry a count, never a key: the consumer's own salt and model key
    what it waits for, so chunks stored under another salt or model are never found."""
    producer, _kv_p, consumer, kv_c = _pair(daemon, "m", "m" if other == "salt" else "other-model")
    with producer, consumer:
        tokens = [t + 3000 + len(other) for t in TOKENS]
        producer.store(tokens, BLOCKS, cache_salt="tenant-a")
        expected = clone_caches(kv_c)
        salt = "tenant-b" if other == "salt" else "tenant-a"
        reply = consumer.retrieve_reply_async(tokens, BLOCKS, cache_salt=salt, awaited=(8, SHORT_MS))
        assert reply.result(timeout=10).retrieved_tokens == 0
        assert caches_equal(kv_c, expected)  # not a byte written


def test_malformed_waits_get_a_typed_error_and_change_nothing(daemon: DaemonProcess) -> None:
    producer, _kv_p, consumer, kv_c = _pair(daemon)
    with producer, consumer:
        tokens = [t + 4000 for t in TOKENS]
        producer.store(tokens, BLOCKS)
        expected = clone_caches(kv_c)
        with pytest.raises(ChunkMismatchError, match="await_chunks"):  # more chunks than it holds
            consumer.retrieve_reply_async(tokens, BLOCKS, awaited=(9, 100)).result(timeout=10)
        with pytest.raises(ChunkMismatchError, match="await_chunks"):
            consumer.retrieve_reply_async(tokens, BLOCKS, awaited=(1 << 40, 100)).result(timeout=10)
        for bad in ({"await_chunks": -1}, {"await_ms": -5}):
            body = m.Retrieve(instance_id=2, token_ids=[], block_ids=[], **bad)  # type: ignore[arg-type]
            reply = raw_call(daemon.ipc_endpoint, body)
            assert isinstance(reply, m.Error) and reply.code == "bad_message", reply
        assert caches_equal(kv_c, expected)
        # An absurd bound is capped by the daemon's retrieve_wait_timeout_s, not refused.
        assert consumer.retrieve_reply_async(tokens, BLOCKS, awaited=(8, 1 << 40)).result(timeout=10)
        assert consumer.lookup(tokens) == 128 and daemon.proc.poll() is None


def test_a_tail_chunk_is_found_only_with_its_secret_and_prompt(daemon: DaemonProcess) -> None:
    """The prefill side's tail (the blocks past the last whole chunk, padded to one chunk under
    ``tail_extra``) is never part of an ordinary prefix: a lookup of the prompt stops at the
    whole chunks, and only the secret's holder with the same prompt before it finds the tail."""
    producer, kv_p, consumer, kv_c = _pair(daemon)
    with producer, consumer:
        prompt = [t + 5000 for t in range(16 * 3 + 12)]  # 3 whole chunks, then 3 whole blocks
        whole, tail = 48, 12
        producer.store(prompt[:whole], BLOCKS[: whole // 4])
        tokens, ids = tail_chunk(prompt, whole, tail, BLOCKS, 16, 4)
        extra = tail_extra("", SECRET, prompt, whole)
        assert producer.store(tokens, ids, key_extra=extra).stored_chunks == 1
        assert consumer.lookup(prompt) == whole  # an ordinary lookup: the whole chunks only
        assert consumer.lookup(prompt + prompt) == whole
        assert consumer.lookup(tokens) == 0  # the padded tail as an ordinary prompt
        assert consumer.lookup(tokens, key_extra=tail_extra("", SECRET[::-1], prompt, whole)) == 0
        other_prefix = [7, *prompt[1:]]
        assert consumer.lookup(tokens, key_extra=tail_extra("", SECRET, other_prefix, whole)) == 0
        assert consumer.lookup(tokens, key_extra=extra) == 16  # the holder of the parameters
        assert consumer.retrieve(tokens, ids, key_extra=extra) == 16
        assert caches_equal([t[:, ids[:3]] for t in kv_c], [t[:, ids[:3]] for t in kv_p])
