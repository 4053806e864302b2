"""A request past its principal's bound is refused by the I/O thread, not by a worker.

Why it matters: a flood of refused work must cost the daemon as little as possible, since every
microsecond spent refusing it is taken from the other tenants under one GIL. A retrieve that
awaits a prefill's chunks, sent by a principal already holding ``--max-awaiting-retrieves``
of them, used to be queued for a bulk worker, built (its ids unpacked and checked) and only
then refused: 18,000 such refusals took about half the daemon's CPU in an await flood. The test
makes "refused before any worker looks at it" a fact it can see: the only bulk worker is held
in a gated store, and the refusal must still come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvcache.client import KVCacheClient
from kvcache.config import EngineConfig
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.admission import await_left
from kvcache.server.daemon import Daemon, DaemonConfig
from kvcache.server.handlers import Handlers, Limits
from kvcache.server.registry import InstanceRegistry
from tests.server.helpers import raw_dealer, small_kv_cache
from tests.server.test_daemon_loop import GatedEngine

TOKENS, BLOCKS = list(range(64)), list(range(16))


@pytest.fixture
def daemon() -> Iterator[tuple[Daemon, GatedEngine]]:
    """One bulk worker, and at most one awaiting retrieve per principal."""
    engine = GatedEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    handlers = Handlers(engine, InstanceRegistry(), 30.0, limits=Limits(max_awaiting_retrieves=1))
    d = Daemon(DaemonConfig(port=0, bulk_workers=1), handlers)
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    yield d, engine
    engine.gate.set()
    d.request_stop()
    thread.join(30)
    engine.close()


def test_an_await_past_the_count_bound_is_refused_while_every_bulk_worker_is_busy(
    daemon: tuple[Daemon, GatedEngine],
) -> None:
    d, engine = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(small_kv_cache())
        with raw_dealer(d.endpoint) as sock:
            nobody = pack_ids([t + 5000 for t in TOKENS])  # a prompt nobody stores
            awaiting = m.Retrieve(instance_id=1, token=c.session.token, token_ids=nobody,
                                  block_ids=pack_ids(BLOCKS), await_chunks=1, await_ms=20_000)  # fmt: skip
            sock.send(encode_request(1, awaiting))  # held: the principal's one await
            store = m.Store(instance_id=1, token=c.session.token, token_ids=pack_ids(TOKENS),
                            block_ids=pack_ids(BLOCKS))  # fmt: skip
            sock.send(encode_request(2, store))  # then the only bulk worker is held in it
            assert engine.entered.wait(10)
            sock.send(encode_request(3, awaiting))  # past the bound
            assert sock.poll(10_000), "the refusal waited for a bulk worker"
            reply = decode_reply(sock.recv())
            assert reply.id == 3
            assert isinstance(reply.body, m.Error) and reply.body.code is m.ErrorCode.LIMIT, reply.body
            assert "--max-awaiting-retrieves" in reply.body.message
            engine.gate.set()
            assert sock.poll(10_000)
            assert isinstance(decode_reply(sock.recv()).body, m.StoreResult)


def test_an_await_holds_its_bound_from_the_moment_it_is_read(daemon: tuple[Daemon, GatedEngine]) -> None:
    """Two awaits queued behind a busy worker, one allowed: the second is refused at read.
    When the bound was taken by the worker, both were below it at read, and the refusal of
    the second waited for the worker, a build and a deferred reply (a flood of 5,000 read
    faster than the workers submit was refused that way, 2,929 times, in one burst)."""
    d, engine = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(small_kv_cache())
        with raw_dealer(d.endpoint) as sock:
            store = m.Store(instance_id=1, token=c.session.token, token_ids=pack_ids(TOKENS),
                            block_ids=pack_ids(BLOCKS))  # fmt: skip
            sock.send(encode_request(1, store))  # the only bulk worker is held in it
            assert engine.entered.wait(10)
            nobody = pack_ids([t + 5000 for t in TOKENS])
            awaiting = m.Retrieve(instance_id=1, token=c.session.token, token_ids=nobody,
                                  block_ids=pack_ids(BLOCKS), await_chunks=1, await_ms=20_000)  # fmt: skip
            sock.send(encode_request(2, awaiting))  # queued: holds the principal's one await
            sock.send(encode_request(3, awaiting))  # past the bound already
            assert sock.poll(10_000), "the second await's refusal waited for the worker"
            reply = decode_reply(sock.recv())
            assert reply.id == 3
            assert isinstance(reply.body, m.Error) and reply.body.code is m.ErrorCode.LIMIT, reply.body
            engine.gate.set()
            assert sock.poll(10_000)
            assert isinstance(decode_reply(sock.recv()).body, m.StoreResult)


def test_an_awaits_bound_counts_from_its_read_not_from_its_worker() -> None:
    """Time a request waited for a worker is taken off its await bound (never below 0)."""
    body = m.Retrieve(instance_id=1, token_ids=pack_ids(TOKENS), block_ids=pack_ids(BLOCKS),
                      await_chunks=1, await_ms=1000)  # fmt: skip
    now = time.monotonic()
    left = await_left(body, now - 0.4).await_ms
    assert 500 <= left <= 600  # 0.4 s queued, less what this line took
    assert await_left(body, now - 5.0).await_ms == 0
    assert await_left(body, now - 5.0).token_ids == body.token_ids
