"""Stores short of L1 room: ``store_async`` returns at once and the engine's waiter does the rest.

Observed before: ``store_async`` reserved its slots on the caller's thread and waited there
(up to ``store_wait_timeout_s``) for room held by other operations, so an engine step, or a
daemon worker serving every client, stood still behind someone else's copies. Now the caller
reserves only what is free and hands the rest to one engine-owned thread, which keeps the
old rules: bounded by the store's deadline, no copy after the deadline, failed chunks counted,
one ``MP_STORE_END``, the future always resolved.

L1 holds exactly one prompt (4 chunk slots, no watermark eviction); the first store's copy is
held by a gate (an event per copy, never a sleep), so "L1 is full of pinned chunks" is a state
the test set up.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

import kvcache.context
from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine, StoreResult
from kvcache.errors import DeadlineExceededError
from kvcache.layouts import KVFormat
from kvcache.observability.event import EventType
from kvcache.testing import make_kv_caches
from kvcache.transfer.cpu import CpuTransferHandler
from tests.engine.test_async import CopyGate
from tests.helpers import RecordingSink

BS, CS = 16, 32
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
PROMPT_BLOCKS = 8  # 128 tokens = 4 chunks = the whole L1
NB = 4 * PROMPT_BLOCKS


def prompt(p: int) -> list[int]:
    return [p * 100_000 + t for t in range(PROMPT_BLOCKS * BS)]


def blocks(p: int) -> list[int]:
    return list(range(p * PROMPT_BLOCKS, (p + 1) * PROMPT_BLOCKS))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyGate]:
    """Every context registered during the test copies through the gate."""
    g = CopyGate()
    monkeypatch.setattr(kvcache.context, "CpuTransferHandler", functools.partial(CpuTransferHandler, copy=g))
    yield g
    g.allow(1000)  # never leave a worker parked


def make_engine(sink: RecordingSink | None = None, **kw: Any) -> tuple[CacheEngine, list[torch.Tensor]]:
    """An engine whose L1 holds exactly one prompt, instance 1 registered."""
    caches = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=1)
    assert isinstance(caches, list)
    with CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22)) as probe:
        probe.register(1, "m", caches)
        slot = int(probe.status()["instances"][0]["chunk_bytes"])
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=4 * slot, l1_extent_bytes=slot,
                       l1_evict_watermark=1.0, **kw)  # fmt: skip
    e = CacheEngine(cfg, bus=sink)
    e.register(1, "m", caches)
    return e, caches


def block_bytes(t: torch.Tensor, p: int) -> torch.Tensor:
    """Prompt ``p``'s blocks of one layer (FMT: ``[2, NB, BS, NH, HS]``), as bytes."""
    return t[:, p * PROMPT_BLOCKS : (p + 1) * PROMPT_BLOCKS].contiguous().view(torch.uint8)


def returns_at_once(call: Callable[[], Future[StoreResult]]) -> Future[StoreResult]:
    """Run ``call`` on a thread of its own: it must return long before any wait for room
    could end (the tests' bound is a minute), or it waited on its caller's thread."""
    got: list[Future[StoreResult]] = []
    caller = threading.Thread(target=lambda: got.append(call()))
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "store_async waited for L1 room on its caller's thread"
    return got[0]


def fill_l1(e: CacheEngine, gate: CopyGate) -> Future[StoreResult]:
    """Store prompt 0 (all of L1) with its copy held: every slot is pinned until ``allow``."""
    held = e.store_async(1, prompt(0), blocks(0), request_id="held")
    gate.wait_started()
    return held


def ends(sink: RecordingSink, request_id: str) -> list[Any]:
    return [ev.metadata for ev in sink.of(EventType.MP_STORE_END) if ev.session_id == request_id]


def test_a_store_short_of_room_returns_at_once_and_stores_once_room_is_released(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, caches = make_engine(sink, store_wait_timeout_s=60.0)
    held = fill_l1(e, gate)
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1), request_id="w"))
    assert not waiting.done() and not ends(sink, "w")
    gate.allow()  # the held copy finishes: its chunks become evictable, room for the waiter
    assert held.result(30).stored_chunks == 4
    gate.allow()  # the waiting store's own copy
    result = waiting.result(30)
    assert (result.stored_chunks, result.skipped_chunks, result.failed_chunks) == (4, 0, 0)
    (end,) = ends(sink, "w")
    assert end.success and end.stored_chunks == 4
    assert e.lookup(1, prompt(1)) == 4 * CS
    gate.allow()
    assert e.retrieve(1, prompt(1), blocks(2)) == 4 * CS  # the bytes stored are blocks(1)'s
    assert all(torch.equal(block_bytes(t, 2), block_bytes(t, 1)) for t in caches)
    e.close()


def test_a_waiting_store_fails_its_chunks_when_its_wait_bound_passes(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, _ = make_engine(sink, store_wait_timeout_s=0.2)
    held = fill_l1(e, gate)
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1), request_id="w"))
    result = waiting.result(30)  # resolved while the held copy still holds every slot
    assert (result.stored_chunks, result.failed_chunks) == (0, 4)
    (end,) = ends(sink, "w")
    assert end.failed_chunks == 4
    assert not held.done()
    gate.allow()
    assert held.result(30).stored_chunks == 4
    assert e.status()["l1"]["num_chunks"] == 4  # the failed store left no slot behind
    e.close()


def test_the_deadline_passing_while_waiting_copies_nothing_and_a_callback_there_may_not_wait(
    gate: CopyGate,
) -> None:
    """The store resolves on the waiter's thread: a done-callback there may submit, but a
    blocking store would wait for the waiter itself, so it is refused."""
    e, _ = make_engine(store_wait_timeout_s=60.0)
    held = fill_l1(e, gate)
    deadline = Deadline.within(1.0)  # a moment of time: no event marks the client giving up
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1), deadline=deadline))
    refused: list[BaseException] = []
    chained: list[Future[StoreResult]] = []
    returned = threading.Event()

    def callback(_f: Future[StoreResult]) -> None:
        try:
            e.store(1, prompt(2), blocks(2))
        except RuntimeError as err:
            refused.append(err)
        chained.append(e.store_async(1, prompt(3), blocks(3)))
        returned.set()

    waiting.add_done_callback(callback)
    assert isinstance(waiting.exception(30), DeadlineExceededError)
    assert returned.wait(30)  # (exception() may return before the callbacks ran)
    assert deadline.passed()
    assert e.status()["l1"]["num_chunks"] == 4  # nothing reserved, so nothing copied
    assert len(refused) == 1 and "done-callback" in str(refused[0])
    gate.allow(10)
    assert held.result(30).stored_chunks == 4
    assert chained[0].result(30).stored_chunks == 4
    assert e.lookup(1, prompt(1)) == 0
    e.close()


def test_close_resolves_a_waiting_store(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, _ = make_engine(sink, store_wait_timeout_s=60.0)
    held = fill_l1(e, gate)
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1), request_id="w"))
    closer = threading.Thread(target=e.close)
    closer.start()
    result = waiting.result(30)  # it stops waiting at once; the held copy still holds L1
    assert (result.stored_chunks, result.failed_chunks) == (0, 4)
    assert len(ends(sink, "w")) == 1
    assert not held.done()
    gate.allow()
    closer.join(30)
    assert not closer.is_alive() and held.result(0).stored_chunks == 4


def test_unregister_resolves_the_instances_waiting_stores_first(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, _ = make_engine(sink, store_wait_timeout_s=60.0)
    held = fill_l1(e, gate)
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1), request_id="w"))
    leaving = threading.Thread(target=e.unregister, args=(1,))
    leaving.start()
    assert waiting.result(30).failed_chunks == 4
    gate.allow()
    leaving.join(30)
    assert not leaving.is_alive() and held.result(0).stored_chunks == 4
    kinds = [(ev.event_type, ev.session_id) for ev in sink.events]
    assert kinds.index((EventType.MP_STORE_END, "w")) < kinds.index((EventType.INSTANCE_UNREGISTERED, ""))
    e.close()


def test_a_later_store_of_the_instance_queues_behind_its_waiting_store(gate: CopyGate) -> None:
    """Prompt 0's chunks are reserved (held), so a second store of prompt 0 would be all
    skipped at once; behind instance 1's waiting store it must wait its turn, while the same
    store from instance 2 (no store waiting there) is answered at once."""
    e, caches = make_engine(store_wait_timeout_s=60.0)
    e.register(2, "m", caches)  # same model and geometry: the same keys
    held = fill_l1(e, gate)
    order: list[str] = []
    waiting = returns_at_once(lambda: e.store_async(1, prompt(1), blocks(1)))
    waiting.add_done_callback(lambda _f: order.append("waiting"))
    later = returns_at_once(lambda: e.store_async(1, prompt(0), blocks(0)))
    later.add_done_callback(lambda _f: order.append("later"))
    elsewhere = returns_at_once(lambda: e.store_async(2, prompt(0), blocks(0)))
    assert elsewhere.result(0).skipped_chunks == 4
    assert not later.done()
    gate.allow()  # held done; the waiting store takes L1 and copies
    assert held.result(30).stored_chunks == 4
    gate.allow()  # the waiting store's copy; then the later one waits for room in turn
    assert waiting.result(30).stored_chunks == 4
    gate.allow()  # the later store's copy (prompt 0 was evicted for the waiting one)
    assert later.result(30).stored_chunks == 4
    assert order == ["waiting", "later"]
    e.close()
