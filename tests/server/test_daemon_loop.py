"""The I/O loop's scheduling promises, with the daemon in a thread and a store held open.

The engine is the real ``CacheEngine``; only its ``store_async`` waits on a gate the test
opens before it submits (as it does when L1 room is held by write-through, so the store holds
its worker), so "a store is in flight" is a fact the test controls rather than a race it
hopes to win. ``test_daemon_copies`` holds the copies themselves instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvcache.client import KVCacheClient
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.protocol.errors import ShuttingDownError
from kvcache.request import StoreRequest
from kvcache.server.daemon import Daemon, DaemonConfig
from kvcache.server.handlers import Handlers
from kvcache.server.lanes import INLINE_LOOKUP_MAX_TOKENS
from kvcache.server.registry import InstanceRegistry
from tests.server.helpers import raw_dealer, small_kv_cache

TOKENS, BLOCKS = list(range(64)), list(range(16))


class GatedEngine(CacheEngine):
    """A CacheEngine whose stores wait, before submitting, until ``gate`` opens; ``entered``
    says one is waiting."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.lookup_entered = threading.Event()

    def submit_store(self, req: StoreRequest) -> Any:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().submit_store(req)

    def lookup_tiers(self, instance_id: int, token_ids: Any, **kw: Any) -> Any:
        if len(token_ids) > INLINE_LOOKUP_MAX_TOKENS:  # held, like a prompt of millions of tokens
            self.lookup_entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().lookup_tiers(instance_id, token_ids, **kw)


@pytest.fixture
def daemon() -> Iterator[tuple[Daemon, GatedEngine, threading.Thread]]:
    engine = GatedEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    d = Daemon(DaemonConfig(port=0, bulk_workers=2), Handlers(engine, InstanceRegistry(), 30.0))
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    yield d, engine, thread
    engine.gate.set()
    d.request_stop()
    thread.join(30)
    engine.close()


def test_a_store_in_flight_never_delays_lookups_or_pings(
    daemon: tuple[Daemon, GatedEngine, threading.Thread],
) -> None:
    d, engine, _ = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=5) as writer, \
            KVCacheClient(d.endpoint, 2, "m", timeout_s=5) as reader:  # fmt: skip
        writer.register_kv_caches(small_kv_cache())
        reader.register_kv_caches(small_kv_cache())
        pending = writer.store_async(TOKENS, BLOCKS)
        assert engine.entered.wait(5)
        for _ in range(20):  # each would time out if it queued behind the held store
            assert reader.lookup(TOKENS) == 0
            assert reader.ping() is True
        assert reader.status()["in_flight"] == 1
        assert not pending.done()
        engine.gate.set()
        assert pending.result(timeout=5).stored_tokens == 64
        assert reader.lookup(TOKENS) == 64  # same model: instance 2 sees instance 1's chunks


def test_a_huge_lookup_never_stalls_the_io_thread(
    daemon: tuple[Daemon, GatedEngine, threading.Thread],
) -> None:
    """Short lookups are answered on the I/O thread; a huge one goes to a worker, so pings,
    short lookups and block reports keep flowing while it is hashed."""
    d, engine, _ = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=5) as client:
        client.register_kv_caches(small_kv_cache())
        ctx = zmq.Context.instance()
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(d.endpoint)
        try:
            huge = list(range(INLINE_LOOKUP_MAX_TOKENS + 1))
            big.send(encode_request(1, m.Lookup(instance_id=1, token_ids=pack_ids(huge))))
            assert engine.lookup_entered.wait(10)
            for _ in range(20):  # each would time out if the I/O thread were hashing the huge one
                assert client.ping() is True
                assert client.lookup(TOKENS) == 0
            engine.gate.set()
            assert big.poll(10_000)
            assert decode_reply(big.recv()).body == m.LookupResult(hit_tokens=0)
        finally:
            big.close()


def test_stop_refuses_new_work_but_finishes_the_store_in_flight(
    daemon: tuple[Daemon, GatedEngine, threading.Thread],
) -> None:
    d, engine, thread = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(small_kv_cache())
        pending = c.store_async(TOKENS, BLOCKS)
        assert engine.entered.wait(5)
        d.request_stop()
        with pytest.raises(ShuttingDownError):
            c.lookup(TOKENS)
        assert thread.is_alive()  # still draining
        engine.gate.set()
        assert pending.result(timeout=5).stored_tokens == 64
        thread.join(10)
        assert not thread.is_alive()
        assert engine.lookup(1, TOKENS) == 64  # the store really happened
        c.close(unregister=False)


def test_requests_queued_at_stop_are_refused_at_once(
    daemon: tuple[Daemon, GatedEngine, threading.Thread],
) -> None:
    """Both bulk workers hold a store; two more stores wait in the lane. On stop, those two
    get ``SHUTTING_DOWN`` right away instead of waiting out their clients' timeouts."""
    d, engine, thread = daemon
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(small_kv_cache())
        socks = [_raw_store(d.endpoint, c) for _ in range(4)]  # 2 run (held), 2 wait in the lane
        assert engine.entered.wait(5)
        for _ in range(500):  # until all four reached the daemon (status is on the fast lane)
            if c.status()["in_flight"] == 4:
                break
        assert c.status()["in_flight"] == 4
        d.request_stop()
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        refused: list[Any] = []
        deadline = time.monotonic() + 5
        while len(refused) < 2 and time.monotonic() < deadline:  # no reply may take 20 s
            for sock, _ in poller.poll(100):
                reply = decode_reply(sock.recv()).body
                assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.SHUTTING_DOWN, reply
                refused.append(sock)
                poller.unregister(sock)
        assert len(refused) == 2, "the queued requests were not refused at once"
        engine.gate.set()
        for sock in socks:
            if sock not in refused:  # the two in flight finish normally
                assert sock.poll(10000)
                assert isinstance(decode_reply(sock.recv()).body, m.StoreResult)
        for sock in socks:
            sock.close()
        thread.join(10)
        assert not thread.is_alive()
        c.close(unregister=False)


def _raw_store(endpoint: str, c: KVCacheClient) -> Any:
    """A store sent on its own socket, then left waiting (the reply is read by the caller)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body = m.Store(instance_id=c.instance_id, token=c.session.token, token_ids=pack_ids(TOKENS),
                   block_ids=pack_ids(BLOCKS))  # fmt: skip
    sock.send(encode_request(1, body))
    return sock


def _record_yields(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that call ``os.sched_yield`` from now on, in order."""
    yielded_on: list[str] = []
    real_yield = os.sched_yield

    def recorded_yield() -> None:
        yielded_on.append(threading.current_thread().name)
        real_yield()

    monkeypatch.setattr(os, "sched_yield", recorded_yield)
    return yielded_on


@pytest.mark.parametrize(("interval_s", "shared"), [(0.0, False), (3600.0, True), (3600.0, False)])
def test_a_read_of_the_socket_yields_the_processor_as_it_forwards(
    daemon: tuple[Daemon, GatedEngine, threading.Thread],
    monkeypatch: pytest.MonkeyPatch,
    interval_s: float,
    shared: bool,
) -> None:
    """A flood read on a busy core never blocks, so the threads it wakes (workers, completions)
    would wait for the kernel to take the core from it; each stop to forward replies also
    yields the processor, on the I/O thread: every ``FORWARD_EVERY_S`` of reading (0 here:
    at every message), and between every two messages while principals share the daemon,
    however long the interval (an hour here). Alone, with an hour's interval, none."""
    d, _, thread = daemon
    monkeypatch.setattr("kvcache.server.daemon.FORWARD_EVERY_S", interval_s)
    monkeypatch.setattr(d._share, "others_active", lambda name, now: shared)
    yielded_on = _record_yields(monkeypatch)
    with raw_dealer(d.endpoint) as sock:
        for i in range(50):
            sock.send(encode_request(i, m.Ping()))
        for _ in range(50):
            assert sock.poll(5000)
            assert isinstance(decode_reply(sock.recv()).body, m.Pong)
    if interval_s == 0.0 or shared:
        assert thread.name in yielded_on, yielded_on[:5]
    else:
        assert thread.name not in yielded_on, "the read yielded with one principal, inside its interval"


def test_a_principal_alone_on_the_lanes_reads_its_own_messages_without_a_stop_at_each(
    daemon: tuple[Daemon, GatedEngine, threading.Thread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop between every two messages is for another principal: the sender of the
    message just read, active on the lanes itself (its status requests), is not one. With the
    interval an hour, the real ``others_active``, and one principal, the read never yields."""
    d, _, thread = daemon
    monkeypatch.setattr("kvcache.server.daemon.FORWARD_EVERY_S", 3600.0)
    yielded_on = _record_yields(monkeypatch)
    with raw_dealer(d.endpoint) as sock:
        for round_ in range(20):  # its lanes' linger keeps it active from the first on
            for i in range(10):
                sock.send(encode_request(round_ * 10 + i, m.Status()))
            for _ in range(10):
                assert sock.poll(5000)
                assert not isinstance(decode_reply(sock.recv()).body, m.Error)
    assert thread.name not in yielded_on, "the read stopped at each message of the one principal"
