"""The pipelined client against a real daemon: many calls in flight, each on its own.

A load is held at the daemon, through its public event bus: every L2 load waits inside its
``L2_LOAD_FINISHED`` announcement (``HeldLoads``), and, for the timeout test, the retrieve's
``MP_RETRIEVE_END`` waits too, so its reply is not sent before the client gives up. Holding
is a state the test sets up with semaphores, never a sleep; the only clock is the call
timeout under test. The daemon-killed test stops a daemon process with SIGSTOP (its requests
then wait in the socket) and kills it with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.errors import DaemonUnavailableError
from kvcache.layouts import KVFormat
from kvcache.observability.event import Event, EventType
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.daemon import Daemon, DaemonConfig
from kvcache.server.handlers import Handlers
from kvcache.server.launch import DaemonProcess
from kvcache.server.registry import InstanceRegistry
from kvcache.testing import make_kv_caches
from tests.client.helpers import ARGS, wait_for
from tests.engine.test_retrieve_waiter import HeldLoads

CS, BS = 16, 4
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
ON_DISK = list(range(9000, 9000 + 4 * CS))  # on disk only: a load of it is held
LOAD_BLOCKS, STORE_BLOCKS = list(range(16, 32)), list(range(32, 48))


def _kv(seed: int, num_blocks: int = 64) -> list[torch.Tensor]:
    kv = make_kv_caches(FMT, num_layers=2, num_blocks=num_blocks, block_size=BS, num_heads=2, head_size=8,
                        dtype=torch.float16, seed=seed)  # fmt: skip
    assert isinstance(kv, list)
    return kv


def _tokens(i: int, chunks: int = 4) -> list[int]:
    return [i * 100_000 + t for t in range(chunks * CS)]


class HeldDaemonBus(HeldLoads):
    """``HeldLoads``, and once ``hold_ends`` is set, every ``MP_RETRIEVE_END`` held too."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_ends = threading.Event()
        self.ends_reached = threading.Semaphore(0)
        self._ends = threading.Semaphore(0)

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is EventType.MP_RETRIEVE_END and self.hold_ends.is_set():
            self.ends_reached.release()
            assert self._ends.acquire(timeout=60), "the test never let the retrieve end"

    def allow_ends(self, n: int = 1000) -> None:
        for _ in range(n):
            self._ends.release()


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Daemon, HeldDaemonBus]]:
    """A daemon in a thread over an engine whose disk tier holds ON_DISK (stored by another
    engine), every L2 load held until the test allows it."""
    config = EngineConfig(chunk_size=CS, l1_size_bytes=8 << 20, l2_disk_path=str(tmp_path),
                          retrieve_wait_timeout_s=60)  # fmt: skip
    with CacheEngine(config) as writer:
        writer.register(1, "m", _kv(1))
        assert writer.store(1, ON_DISK, list(range(16))).stored_chunks == 4
    bus = HeldDaemonBus()
    engine = CacheEngine(config, bus)
    d = Daemon(DaemonConfig(port=0, inline_lookups=False), Handlers(engine, InstanceRegistry(), 30.0))
    thread = threading.Thread(target=d.serve, name="daemon-under-test")
    thread.start()
    yield d, bus
    bus.allow(1000)
    bus.allow_ends()
    d.request_stop()
    thread.join(30)
    engine.close()


def _hold_a_load(c: KVCacheClient, bus: HeldDaemonBus) -> Future[int]:
    """A retrieve of ON_DISK whose chunks are still loading (held): in flight until allowed."""
    assert c.lookup(ON_DISK) == len(ON_DISK)  # found on disk: the lookup starts the loads
    bus.wait_reached(1)
    return c.retrieve_async(ON_DISK, LOAD_BLOCKS)


def test_64_calls_in_flight_each_get_their_own_reply(daemon: DaemonProcess) -> None:
    """64 stores, then 64 retrieves of prompts of 1 to 4 chunks, all issued before any is
    waited for: each future holds its own call's reply, and the bytes are exact."""
    n, per = 64, 4 * 4  # prompts; blocks kept for each (up to 4 chunks of 4 blocks)
    kv = to_shared(_kv(40, num_blocks=n * per))
    original = [t.clone() for t in kv]
    prompts = [_tokens(500 + i, chunks=1 + i % 4) for i in range(n)]
    blocks = [list(range(i * per, i * per + len(p) // BS)) for i, p in enumerate(prompts)]
    with KVCacheClient(daemon.endpoint, 40, "window", timeout_s=30, window=n) as c:
        c.register_kv_caches(kv)
        stores = [c.store_async(p, b) for p, b in zip(prompts, blocks, strict=True)]
        assert [f.result(timeout=60).stored_tokens for f in stores] == [len(p) for p in prompts]
        for t in kv:
            t.zero_()
        loads = [c.retrieve_async(p, b) for p, b in zip(prompts, blocks, strict=True)]
        assert [f.result(timeout=60) for f in loads] == [len(p) for p in prompts]
        for got, want in zip(kv, original, strict=True):  # [kv, block, ...] per layer
            for b in blocks:
                assert torch.equal(got[:, b].view(torch.uint8), want[:, b].view(torch.uint8))
        assert c.breaker.trips == 0


def test_a_held_load_does_not_delay_a_later_store(held: tuple[Daemon, HeldDaemonBus]) -> None:
    d, bus = held
    with KVCacheClient(d.endpoint, 2, "m", timeout_s=30) as c:
        kv = to_shared(_kv(2))
        c.register_kv_caches(kv)
        load = _hold_a_load(c, bus)
        store = c.store_async(_tokens(1), STORE_BLOCKS)
        assert store.result(timeout=30).stored_tokens == 4 * CS  # answered while the load is held
        assert not load.done()
        bus.allow(1000)
        assert load.result(timeout=30) == len(ON_DISK)
        want = _kv(1)[0][:, :16]  # the bytes the writer stored
        assert torch.equal(kv[0][:, 16:32].view(torch.uint8), want.view(torch.uint8))


def test_one_call_at_a_time_the_store_waits_for_the_held_load(held: tuple[Daemon, HeldDaemonBus]) -> None:
    """``window=1``, the client as it was: the store is sent only once the load is answered."""
    d, bus = held
    with KVCacheClient(d.endpoint, 3, "m", timeout_s=30, window=1) as c:
        c.register_kv_caches(to_shared(_kv(3)))
        order: list[str] = []
        load = _hold_a_load(c, bus)
        load.add_done_callback(lambda _f: order.append("load"))
        store = c.store_async(_tokens(2), STORE_BLOCKS)
        store.add_done_callback(lambda _f: order.append("store"))
        bus.allow(1000)
        assert load.result(timeout=30) == len(ON_DISK) and store.result(timeout=30).stored_tokens == 4 * CS
        assert order == ["load", "store"]


def test_a_timeout_fails_only_its_call(held: tuple[Daemon, HeldDaemonBus]) -> None:
    """The held load's reply is held past the client's deadline: that call alone fails, the
    breaker stays closed (the daemon answered other calls meanwhile), the late reply is
    dropped by id, nothing was written into the load's blocks, and the socket serves on."""
    d, bus = held
    with KVCacheClient(d.endpoint, 4, "m", timeout_s=2) as c:
        kv = to_shared(_kv(4))
        for t in kv:
            t[:, 16:32].zero_()
        c.register_kv_caches(kv)
        bus.hold_ends.set()
        load = _hold_a_load(c, bus)
        store = c.store_async(_tokens(3), STORE_BLOCKS)
        assert store.result(timeout=30).stored_tokens == 4 * CS
        with pytest.raises(DaemonUnavailableError, match="no reply"):
            load.result(timeout=30)
        assert not c.breaker.open and c.breaker.trips == 0
        bus.allow(1000)
        bus.allow_ends()  # the daemon answers the load now, late: its reply is dropped
        wait_for(lambda: c.status()["in_flight"] == 0, 30, "the late reply")
        assert all(not t[:, 16:32].any() for t in kv)  # nothing applied after the deadline
        assert c.store_async(_tokens(4), STORE_BLOCKS).result(timeout=30).stored_tokens == 4 * CS
        assert c.breaker.trips == 0


def test_the_daemon_stopped_then_killed_mid_window() -> None:
    """Calls in flight at a daemon that stopped (SIGSTOP) all fail by their deadlines and
    open the breaker; woken, the daemon applies none of them (each arrived past its
    deadline). Killed with calls in flight, every call is still answered."""
    d = DaemonProcess(ARGS)
    try:
        kv = to_shared(_kv(5))
        with KVCacheClient(d.endpoint, 5, "stopped", timeout_s=2) as c:
            c.register_kv_caches(kv)
            assert c.store(ON_DISK, list(range(16))).stored_tokens == len(ON_DISK)
            for t in kv:
                t[:, 16:32].zero_()
            os.kill(d.pid, signal.SIGSTOP)
            calls: list[Future[Any]] = [c.store_async(_tokens(10 + i, 1), STORE_BLOCKS[:4]) for i in range(8)]
            calls += [c.retrieve_async(ON_DISK, LOAD_BLOCKS) for _ in range(8)]
            for f in calls:
                with pytest.raises(DaemonUnavailableError):
                    f.result(timeout=30)
            assert c.breaker.open
            with pytest.raises(DaemonUnavailableError, match="failing fast"):
                c.store_async(_tokens(30), STORE_BLOCKS).result(timeout=30)
            os.kill(d.pid, signal.SIGCONT)
            wait_for(lambda: not c.breaker.open, 30, "the probe to close the breaker")
            assert [c.lookup(_tokens(10 + i, 1)) for i in range(8)] == [0] * 8  # no store applied
            assert all(not t[:, 16:32].any() for t in kv)  # no retrieve wrote
            os.kill(d.pid, signal.SIGSTOP)
            calls = [c.store_async(_tokens(20 + i, 1), STORE_BLOCKS[:4]) for i in range(8)]
            d.kill()
            for f in calls:
                with pytest.raises(DaemonUnavailableError):
                    f.result(timeout=30)
            c.close(unregister=False)
    finally:
        d.kill()


def test_calls_at_a_daemon_that_exits_fail_at_once_not_at_their_timeout() -> None:
    """Killed with calls in flight (four on the client's thread, one on the caller's own
    channel), each fails as soon as the daemon's process has exited, with an error that says
    so, instead of at its timeout (120 s here): a process that exited copies nothing more, so
    the engine may use the blocks again. A synchronous load used to hold vLLM's whole step
    for the client's timeout after a daemon crash."""
    d = DaemonProcess(ARGS)
    try:
        with KVCacheClient(d.endpoint, 9, "exits", timeout_s=120) as c:
            c.register_kv_caches(to_shared(_kv(9)))
            held = (len(LOAD_BLOCKS) // 4, 60_000)  # chunks nobody stores: held at the daemon
            calls = [c.retrieve_reply_async(_tokens(80 + i), LOAD_BLOCKS, awaited=held) for i in range(4)]
            sync: Future[Any] = Future()
            msg = m.Retrieve(instance_id=9, token_ids=pack_ids(_tokens(90)), block_ids=pack_ids(LOAD_BLOCKS),
                             await_chunks=held[0], await_ms=held[1])  # fmt: skip

            def call_sync() -> None:
                try:
                    sync.set_result(c.session.call(msg, m.RetrieveResult))
                except BaseException as exc:
                    sync.set_exception(exc)

            caller = threading.Thread(target=call_sync)
            caller.start()
            with KVCacheClient(d.endpoint, 10, "watch", timeout_s=10) as watch:  # c's channel is busy
                wait_for(lambda: watch.status()["in_flight"] >= 5, 30, "the five calls to be held")
            d.kill()
            for f in [*calls, sync]:
                with pytest.raises(DaemonUnavailableError, match=r"exited with this Retrieve in flight"):
                    f.result(timeout=60)  # not 120: the timeout is not what ended them
            caller.join()
            c.close(unregister=False)
    finally:
        d.kill()


def test_close_does_not_wait_for_a_notice_at_a_stopped_daemon() -> None:
    """An end-of-request notice (or a block report) is fire and forget: ``close`` still sends
    it, but does not wait out the call's deadline for its reply, as it does for a store or a
    retrieve, which move bytes. (A daemon killed with a block report in flight held the
    scheduler harness's close for the client's whole timeout.) The lost notice is counted."""
    d = DaemonProcess(ARGS)
    try:
        with KVCacheClient(d.endpoint, 7, "notice", timeout_s=120) as c:
            c.register_kv_caches(to_shared(_kv(7)))
            os.kill(d.pid, signal.SIGSTOP)
            c.end_session("r1", wait=False)
            closer = threading.Thread(target=c.close, kwargs={"unregister": False})
            closer.start()
            closer.join(60)  # half the notice's deadline: close must not wait for it at all
            assert not closer.is_alive(), "close waited for the reply to a notice"
            assert c.session.dropped_notices == 1
    finally:
        d.kill()


def test_calls_in_flight_across_a_daemon_restart_are_sent_again(tmp_path: Path) -> None:
    """A daemon restarted in the same place, 32 calls sent at once right after it is up: those
    that meet it before the heartbeat registered the instance again are refused
    (UNKNOWN_INSTANCE, or ACCESS_DENIED with the token being replaced), wait for the one
    re-registration and are sent again; every call is answered by the new daemon."""
    runtime_dir = str(tmp_path / "run")
    kv = to_shared(_kv(6, num_blocks=32 * 4))
    with DaemonProcess(ARGS, runtime_dir=runtime_dir) as first:
        c = KVCacheClient(first.endpoint, 6, "restart", timeout_s=10)
        c.register_kv_caches(kv)
        first_token = c.session.token
    try:
        with DaemonProcess(ARGS, runtime_dir=runtime_dir):
            calls = [c.store_async(_tokens(50 + i, 1), list(range(4 * i, 4 * i + 4))) for i in range(32)]
            assert [f.result(timeout=60).stored_tokens for f in calls] == [CS] * 32
            assert c.session.token != first_token
            assert c.lookup(_tokens(50, 1)) == CS
            c.close()
    finally:
        c.close(unregister=False)


def test_an_idle_unregistered_client_thread_waits_instead_of_spinning(daemon: DaemonProcess) -> None:
    """A client that never registered (vLLM's scheduler half: lookups and reports only) has no
    heartbeat to send. Its thread must then block until the next call, not poll with a zero
    wait once a heartbeat interval (1 s) has passed since its last send: that spun a core and
    contended for the GIL with vLLM's stepping thread (issue 42 §1). Counted in loop turns."""
    with KVCacheClient(daemon.endpoint, 77, "m", timeout_s=5) as c:
        assert c.status()["engine"]["chunk_size"]
        pipeline = c.session._pipeline
        turns = [0]
        heartbeat = pipeline._heartbeat

        def counted(chan: Any) -> None:
            turns[0] += 1
            heartbeat(chan)

        pipeline._heartbeat = counted  # type: ignore[method-assign]
        c.end_session("r", wait=False)  # fire and forget: on the thread (it starts it)
        threading.Event().wait(2.5)  # an observation window past the 1 s interval, not a sync
        assert turns[0] <= 5, f"the idle client thread turned {turns[0]} times in 2.5 s"
        assert c.status()["engine"]["chunk_size"]  # still serves calls
