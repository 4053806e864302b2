"""Stores and retrieves answered when their copies complete: no daemon worker waits on a copy.

The daemon runs in a thread over a real ``CacheEngine``; every copy passes a gate in the CPU
transfer handler (a semaphore per copy, never a sleep), so "N copies are held" is a state the
test set up. The daemon has one worker per lane: if a held copy parked a worker, the bulk
request sent after the stores (a registration) could not be answered until the gate opened.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import kvcache.context
from kvcache import _native
from kvcache.client import KVCacheClient
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.protocol.errors import RemoteError, ShuttingDownError
from kvcache.request import RetrieveRequest, StoreRequest
from kvcache.server.daemon import Daemon, DaemonConfig
from kvcache.server.handlers import Handlers
from kvcache.server.registry import InstanceRegistry, RegistrationRecord
from kvcache.testing import make_kv_caches
from kvcache.transfer.cpu import CpuTransferHandler, native_cpu_copy
from kvcache.transfer.validate import CheckedJob
from tests.engine.test_retrieve_waiter import HeldLoads
from tests.server.helpers import small_kv_cache

BLOCKS = list(range(16))
STORES = 4


def tokens(i: int) -> list[int]:
    return [i * 10_000 + t for t in range(64)]


class CopyGate:
    """The transfer handler's copy function: each copy waits for an ``allow``; ``fail_next``
    makes the next one raise (a device fault)."""

    def __init__(self) -> None:
        self._allowed = threading.Semaphore(0)
        self._fail = threading.Event()

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        assert self._allowed.acquire(timeout=60), "the test never let the copy run"
        if self._fail.is_set():
            self._fail.clear()
            raise RuntimeError("injected copy fault")
        native_cpu_copy(table, job, num_threads)

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self._allowed.release()

    def fail_next(self) -> None:
        self._fail.set()


class CountingEngine(CacheEngine):
    """A CacheEngine that says when a store or a retrieve was submitted (``submit_store`` /
    ``submit_retrieve`` returned)."""

    def __init__(self, config: EngineConfig, bus: Any = None) -> None:
        super().__init__(config, bus)
        self.submitted = threading.Semaphore(0)
        self.retrieves = threading.Semaphore(0)

    def submit_store(self, req: StoreRequest) -> Any:
        future = super().submit_store(req)
        self.submitted.release()
        return future

    def submit_retrieve(self, req: RetrieveRequest) -> Any:
        future = super().submit_retrieve(req)
        self.retrieves.release()
        return future


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyGate]:
    g = CopyGate()
    monkeypatch.setattr(kvcache.context, "CpuTransferHandler", functools.partial(CpuTransferHandler, copy=g))
    yield g
    g.allow(1000)  # never leave a copy parked


@pytest.fixture
def daemon(gate: CopyGate) -> Iterator[tuple[Daemon, CountingEngine, threading.Thread]]:
    engine = CountingEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    config = DaemonConfig(port=0, bulk_workers=1, fast_workers=1, inline_lookups=False)
    d = Daemon(config, Handlers(engine, InstanceRegistry(), 30.0))
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    yield d, engine, thread
    gate.allow(1000)
    d.request_stop()
    thread.join(30)
    engine.close()


def _raw_store(endpoint: str, c: KVCacheClient, token_ids: list[int]) -> Any:
    """A store on its own socket (a client sends one request at a time), left waiting."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body = m.Store(instance_id=c.instance_id, token=c.session.token, token_ids=pack_ids(token_ids),
                   block_ids=pack_ids(BLOCKS))  # fmt: skip
    sock.send(encode_request(1, body))
    return sock


def _raw_retrieve(endpoint: str, c: KVCacheClient, token_ids: list[int]) -> Any:
    """A retrieve on its own socket, left waiting (as ``_raw_store``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body = m.Retrieve(instance_id=c.instance_id, token=c.session.token, token_ids=pack_ids(token_ids),
                      block_ids=pack_ids(BLOCKS))  # fmt: skip
    sock.send(encode_request(1, body))
    return sock


def _submitted(engine: CountingEngine, n: int) -> None:
    for _ in range(n):
        assert engine.submitted.acquire(timeout=30), "a store was never submitted"


def test_stores_with_copies_held_occupy_no_worker(
    daemon: tuple[Daemon, CountingEngine, threading.Thread], gate: CopyGate
) -> None:
    d, engine, _ = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as writer, \
            KVCacheClient(d.endpoint, 2, "m", timeout_s=20) as late:  # fmt: skip
        writer.register_kv_caches(small_kv_cache())
        socks = [_raw_store(d.endpoint, writer, tokens(i)) for i in range(STORES)]  # concurrent
        try:
            _submitted(engine, STORES)  # the one bulk worker submitted every store in turn
            late.register_kv_caches(small_kv_cache())  # a bulk request, answered while every copy is held
            assert late.lookup(tokens(0)) == 0  # fast lane; not visible before its copy finished
            assert late.ping() is True
            assert writer.status()["in_flight"] == STORES
            assert not any(sock.poll(0) for sock in socks)  # no store was answered yet
            gate.allow(1000)
            for sock in socks:
                assert sock.poll(20_000)
                reply = decode_reply(sock.recv()).body
                assert isinstance(reply, m.StoreResult) and reply.stored_tokens == 64, reply
        finally:
            for sock in socks:
                sock.close()
        assert all(late.lookup(tokens(i)) == 64 for i in range(STORES))
        assert writer.status()["in_flight"] == 0
        assert late.retrieve(tokens(1), BLOCKS) == 64  # a retrieve is answered on completion too


def test_a_failed_copy_is_an_error_reply_and_the_worker_serves_on(
    daemon: tuple[Daemon, CountingEngine, threading.Thread], gate: CopyGate
) -> None:
    d, _, _ = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(small_kv_cache())
        gate.fail_next()
        gate.allow()
        with pytest.raises(RemoteError) as failed:
            c.store(tokens(0), BLOCKS)
        assert failed.value.code is m.ErrorCode.INTERNAL and "injected copy fault" in str(failed.value)
        assert c.lookup(tokens(0)) == 0  # nothing of the failed store is visible
        gate.allow(1000)
        assert c.store(tokens(0), BLOCKS).stored_tokens == 64


def test_stop_answers_the_copies_in_flight_before_exit(
    daemon: tuple[Daemon, CountingEngine, threading.Thread], gate: CopyGate
) -> None:
    d, engine, thread = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(small_kv_cache())
        pending = c.store_async(tokens(0), BLOCKS)
        _submitted(engine, 1)
        d.request_stop()
        with pytest.raises(ShuttingDownError):
            c.lookup(tokens(0))
        assert thread.is_alive()  # draining: the store's copy is still held
        gate.allow(1000)
        assert pending.result(timeout=20).stored_tokens == 64
        thread.join(20)
        assert not thread.is_alive()
        assert engine.lookup(1, tokens(0)) == 64
        c.close(unregister=False)


def test_submit_maps_the_futures_error_to_the_same_reply_as_handle(gate: CopyGate) -> None:
    """A bad request (block ids out of range, refused when the request is built) and one
    refused later: ``submit`` turns each into the reply ``handle`` gives for it."""
    engine = CacheEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    handlers = Handlers(engine, InstanceRegistry(), 30.0)
    try:
        kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                            block_size=4, head_size=8, dtype=torch.float16)  # fmt: skip
        engine.register(1, "m", kv)
        handlers.registry.add(RegistrationRecord(1, "m", engine.geometry(1), [], token=b"t" * 16))
        bad = m.Store(instance_id=1, token=b"t" * 16, token_ids=pack_ids(tokens(0)),
                      block_ids=pack_ids([99] * 16))  # fmt: skip
        gate.allow(1000)
        via_future = handlers.submit(bad).result(timeout=20)
        assert isinstance(via_future, m.Error) and via_future.code is m.ErrorCode.BLOCK_ID
        assert handlers.handle(bad) == via_future
        gate.fail_next()  # an error that arrives on the engine's future, after the submit
        good = m.Store(instance_id=1, token=b"t" * 16, token_ids=pack_ids(tokens(1)),
                       block_ids=pack_ids(BLOCKS))  # fmt: skip
        faulted = handlers.submit(good).result(timeout=20)
        assert isinstance(faulted, m.Error) and "injected copy fault" in faulted.message
        late = m.Store(instance_id=1, token=b"t" * 16, token_ids=pack_ids(tokens(0)),
                       block_ids=pack_ids(BLOCKS), deadline_ms=1)  # fmt: skip
        refused = handlers.submit(late)
        assert refused.done()  # refused before anything was submitted
        assert refused.result().code is m.ErrorCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
        assert handlers.submit(m.Ping()).result().protocol_version == m.PROTOCOL_VERSION  # type: ignore[union-attr]
    finally:
        engine.close()


def test_a_store_waiting_for_l1_room_occupies_no_worker(gate: CopyGate) -> None:
    """L1 holds one store's chunks and the first store's copy is held, so the second must
    wait for room: it waits on the engine's waiter thread, and the daemon's one bulk worker
    serves a registration meanwhile (before, the worker waited inside ``store_async``)."""
    with CacheEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20)) as probe:
        probe.register(1, "m", small_kv_cache())
        slot = int(probe.status()["instances"][0]["chunk_bytes"])
    engine = CountingEngine(EngineConfig(chunk_size=16, l1_size_bytes=4 * slot, l1_extent_bytes=slot,
                                         l1_evict_watermark=1.0, store_wait_timeout_s=60.0))  # fmt: skip
    config = DaemonConfig(port=0, bulk_workers=1, fast_workers=1, inline_lookups=False)
    d = Daemon(config, Handlers(engine, InstanceRegistry(), 30.0))
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    try:
        with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as writer, \
                KVCacheClient(d.endpoint, 2, "m", timeout_s=20) as late:  # fmt: skip
            writer.register_kv_caches(small_kv_cache())
            socks = [_raw_store(d.endpoint, writer, tokens(0))]
            _submitted(engine, 1)  # its 4 chunks fill L1; the copy is held
            socks.append(_raw_store(d.endpoint, writer, tokens(1)))
            try:
                _submitted(engine, 1)  # store_async returned, short of room
                late.register_kv_caches(small_kv_cache())  # the one bulk worker is free
                assert late.ping() is True
                assert not any(sock.poll(0) for sock in socks)
                gate.allow(1000)
                for sock in socks:
                    assert sock.poll(20_000)
                    reply = decode_reply(sock.recv()).body
                    assert isinstance(reply, m.StoreResult) and reply.stored_tokens == 64, reply
            finally:
                for sock in socks:
                    sock.close()
            assert late.lookup(tokens(1)) == 64
    finally:
        gate.allow(1000)
        d.request_stop()
        thread.join(30)
        engine.close()


def test_a_retrieve_waiting_for_l2_loads_occupies_no_worker(tmp_path: Path) -> None:
    """The prompt is on disk only and its loads are held (inside their end announcements),
    so the retrieve must wait for them: it waits on the engine's retrieve waiter, and the
    daemon's one bulk worker serves a registration meanwhile (before, the worker waited
    inside ``retrieve_async`` for as long as the loads took)."""

    def disk(**kw: Any) -> EngineConfig:
        return EngineConfig(chunk_size=16, l1_size_bytes=64 << 20, l2_disk_path=str(tmp_path), **kw)

    with CacheEngine(disk()) as writer_engine:
        writer_engine.register(1, "m", small_kv_cache())
        assert writer_engine.store(1, tokens(0), BLOCKS).stored_chunks == 4
    sink = HeldLoads()
    engine = CountingEngine(disk(retrieve_wait_timeout_s=60.0), bus=sink)
    config = DaemonConfig(port=0, bulk_workers=1, fast_workers=1, inline_lookups=False)
    d = Daemon(config, Handlers(engine, InstanceRegistry(), 30.0))
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    try:
        with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as reader, \
                KVCacheClient(d.endpoint, 2, "m", timeout_s=20) as late:  # fmt: skip
            reader.register_kv_caches(small_kv_cache())
            assert reader.lookup(tokens(0)) == 64  # its 4 loads start, and are held
            sock = _raw_retrieve(d.endpoint, reader, tokens(0))
            try:
                assert engine.retrieves.acquire(timeout=15), "retrieve_async waited for the loads"
                late.register_kv_caches(small_kv_cache())  # the one bulk worker is free
                assert late.lookup(tokens(0)) == 64 and late.ping() is True
                assert not sock.poll(0)
                sink.allow(1000)
                assert sock.poll(20_000)
                reply = decode_reply(sock.recv()).body
                assert isinstance(reply, m.RetrieveResult) and reply.retrieved_tokens == 64, reply
            finally:
                sock.close()
    finally:
        sink.allow(1000)
        d.request_stop()
        thread.join(30)
        engine.close()
