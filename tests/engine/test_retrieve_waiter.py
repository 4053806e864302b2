"""Retrieves of chunks still loading from L2: ``retrieve_async`` returns at once and the
engine's retrieve waiter does the rest.

Observed before: ``retrieve_async`` pinned the prefix on the caller's thread and waited there
(up to ``retrieve_wait_timeout_s`` and the request's deadline) for the L2 -> L1 loads a lookup
began, so a daemon worker serving every client stood still for as long as disk or Redis took.
Now the caller pins what is READY and hands a prefix still loading to an engine-owned thread,
which keeps the old rules: the first failed load ends the prefix, the wait ends at the
deadline with what is READY, nothing is written after the deadline, one ``MP_RETRIEVE_END``,
the future always resolved, ``close``/``unregister`` resolve a waiting retrieve.

Every L2 load is held inside its ``L2_LOAD_FINISHED`` / ``L2_LOAD_FAILED`` announcement until
the test allows it (a semaphore per load, never a sleep), so "the chunks are still loading"
is a state the test set up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine, RetrieveResult
from kvcache.errors import DeadlineExceededError
from kvcache.keys import ChunkHasher
from kvcache.layouts import KVFormat
from kvcache.observability.event import Event, EventType
from kvcache.request import RetrieveRequest
from kvcache.testing import caches_equal, make_kv_caches
from tests.helpers import RecordingSink, wait_until

BS, CS = 16, 32
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
TOKENS = list(range(500, 500 + 8 * BS))  # 4 chunks
IDS = list(range(8))
ALL = len(TOKENS)


class HeldLoads(RecordingSink):
    """Holds each L2 load inside its end announcement (before the L1 slot settles) until
    ``allow``; ``reached`` counts the loads that got there."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Semaphore(0)
        self._allowed = threading.Semaphore(0)

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type in (EventType.L2_LOAD_FINISHED, EventType.L2_LOAD_FAILED):
            self.reached.release()
            assert self._allowed.acquire(timeout=60), "the test never let the load land"

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self._allowed.release()

    def wait_reached(self, n: int) -> None:
        for _ in range(n):
            assert self.reached.acquire(timeout=30), "a load never reached its end"


def caches(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(FMT, num_blocks=8, block_size=BS, seed=seed)
    assert isinstance(kv, list)
    return kv


@pytest.fixture
def on_disk(tmp_path: Path) -> list[torch.Tensor]:
    """TOKENS stored on disk (by another engine) from caches of seed 1; returns those caches."""
    src = caches(seed=1)
    with CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l2_disk_path=str(tmp_path))) as w:
        w.register(1, "m", src)
        assert w.store(1, TOKENS, IDS).stored_chunks == 4
    return src


@pytest.fixture
def sink() -> Iterator[HeldLoads]:
    s = HeldLoads()
    yield s
    s.allow(1000)  # never leave an L2 worker parked


def reader(tmp_path: Path, sink: HeldLoads, **kw: Any) -> tuple[CacheEngine, list[torch.Tensor]]:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l2_disk_path=str(tmp_path), **kw)
    e = CacheEngine(cfg, bus=sink)
    dst = caches(seed=2)
    e.register(2, "m", dst)
    return e, dst


def returns_at_once(call: Callable[[], Future[RetrieveResult]]) -> Future[RetrieveResult]:
    """Run ``call`` on a thread of its own: it must return while the loads are held (the
    tests hold them for up to a minute), or it waited on its caller's thread."""
    got: list[Future[RetrieveResult]] = []
    caller = threading.Thread(target=lambda: got.append(call()))
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "retrieve_async waited for L2 loads on its caller's thread"
    return got[0]


def ends(sink: RecordingSink) -> list[Any]:
    return [ev.metadata for ev in sink.of(EventType.MP_RETRIEVE_END)]


def snapshot(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in kv]


def untouched(kv: list[torch.Tensor], before: list[torch.Tensor], first_block: int = 0) -> bool:
    return all(
        torch.equal(t[first_block:].view(torch.uint8), b[first_block:].view(torch.uint8))
        for t, b in zip(kv, before, strict=True)
    )


@pytest.mark.parametrize("looked_up", [True, False], ids=["after_lookup", "prefetch_needed"])
def test_a_retrieve_of_loading_chunks_returns_at_once_and_copies_once_they_land(
    tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads, looked_up: bool
) -> None:
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=60.0)
    with e:
        if looked_up:
            assert e.lookup(2, TOKENS) == ALL  # its 4 loads are held
        before = snapshot(dst)
        fut = returns_at_once(lambda: e.retrieve_async(2, TOKENS, IDS))
        assert not fut.done() and not ends(sink) and untouched(dst, before)
        sink.allow(4)
        result = fut.result(30)
        assert result.retrieved_tokens == ALL and result.num_bytes > 0
        assert caches_equal(on_disk, dst)
        (end,) = ends(sink)
        assert end.success and (end.l1_tokens, end.l2_tokens) == (0, ALL)
        assert e.status()["l1"]["pinned_chunks"] == 0


def test_a_failed_load_ends_the_prefix(tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads) -> None:
    scope = b"chunk:" + b"x".join(str(d).encode() for d in (2, 2, CS, 128)) + b":bfloat16"
    key = ChunkHasher("m", CS, scope=scope).keys(TOKENS)[2]  # the third chunk, as the engine keys it
    (victim,) = [p for p in tmp_path.rglob("*.kvc") if p.name.startswith(f"{key:032x}")]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=60.0)
    with e:
        assert e.lookup(2, TOKENS) == ALL  # the index still lists it; the load finds the damage
        before = snapshot(dst)
        fut = returns_at_once(lambda: e.retrieve_async(2, TOKENS, IDS))
        assert not fut.done()
        sink.allow(4)
        assert fut.result(30).retrieved_tokens == 2 * CS
        assert caches_equal([t[:4] for t in on_disk], [t[:4] for t in dst])
        assert untouched(dst, before, first_block=4)  # blocks 4..7: nothing past the failure
        (end,) = ends(sink)
        assert end.success and end.retrieved_tokens == 2 * CS
        assert e.status()["l1"]["pinned_chunks"] == 0


def test_the_wait_ends_at_retrieve_wait_timeout_with_what_is_ready(
    tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads
) -> None:
    wait_s = 2.0
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=wait_s)
    with e:
        e.register(3, "m", caches(seed=3))
        assert e.lookup(2, TOKENS[: 2 * CS]) == 2 * CS
        sink.allow(2)
        assert e.retrieve(3, TOKENS[: 2 * CS], IDS[:4]) == 2 * CS  # chunks 0, 1 READY in L1
        assert e.lookup(2, TOKENS) == ALL  # chunks 2, 3 loading, held
        before = snapshot(dst)
        called = time.monotonic()
        fut = returns_at_once(lambda: e.retrieve_async(2, TOKENS, IDS))
        assert time.monotonic() - called < wait_s, "the caller waited out retrieve_wait_timeout_s"
        assert not fut.done()  # waits off the caller until the timeout: the loads stay held
        assert fut.result(30).retrieved_tokens == 2 * CS
        assert caches_equal([t[:4] for t in on_disk], [t[:4] for t in dst])
        assert untouched(dst, before, first_block=4)
        assert ends(sink)[-1].success
        sink.allow(2)


def test_the_deadline_passing_while_waiting_fails_it_and_writes_nothing(
    tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads
) -> None:
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=60.0)
    with e:
        assert e.lookup(2, TOKENS) == ALL
        before = snapshot(dst)
        deadline = Deadline.within(2.0)
        fut = returns_at_once(lambda: e.retrieve_async(2, TOKENS, IDS, deadline=deadline))
        assert not fut.done()
        with pytest.raises(DeadlineExceededError):
            fut.result(30)
        assert deadline.passed()
        sink.allow(4)  # the loads land after: still nothing is copied
        assert e.flush(10)
        assert untouched(dst, before)
        (end,) = ends(sink)
        assert not end.success and end.retrieved_tokens == 0
        assert e.status()["l1"]["pinned_chunks"] == 0


def _running_instance(waiter: Any) -> int | None:
    """The instance whose job holds the waiter's thread now (None: none does)."""
    with waiter._cv:
        return None if waiter._running is None else int(waiter._running.instance_id)


@pytest.mark.parametrize("how", ["close", "unregister"])
def test_close_or_unregister_resolves_a_waiting_retrieve(
    tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads, how: str
) -> None:
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=60.0)
    try:
        assert e.lookup(2, TOKENS) == ALL
        sink.wait_reached(1)  # a load is held (the others queue behind it or are held too)
        before = snapshot(dst)
        fut = returns_at_once(lambda: e.retrieve_async(2, TOKENS, IDS))
        assert not fut.done()
        stop = threading.Thread(target=e.close if how == "close" else lambda: e.unregister(2))
        stop.start()
        assert fut.result(30).retrieved_tokens == 0  # resolved while the loads are still held
        (end,) = ends(sink)
        assert end.success and end.retrieved_tokens == 0
        assert untouched(dst, before)
        sink.allow(4)
        stop.join(30)
        assert not stop.is_alive()
    finally:
        sink.allow(4)
        e.close()


@pytest.mark.parametrize("how", ["close", "unregister"])
def test_a_long_await_hands_the_waiter_to_later_retrieves_and_still_ends_on_unregister(
    tmp_path: Path, on_disk: list[torch.Tensor], sink: HeldLoads, how: str
) -> None:
    """A retrieve awaiting chunks nobody stores (``await_chunks``, a hostile client's too)
    waits up to its bound on the waiter; a later retrieve that must bring its chunks in from
    L2 runs meanwhile (the wait hands the thread over), and the wait, handed over, still
    ends at once when its instance leaves or the engine closes."""
    e, dst = reader(tmp_path, sink, retrieve_wait_timeout_s=60.0)
    try:
        e.register(3, "m", caches(seed=3))
        never = [t + 10_000 for t in TOKENS]
        req = RetrieveRequest.build(3, e.geometry(3), never, IDS, await_chunks=4, await_s=60.0)
        waiting = e.submit_retrieve(req)
        waiter = e._parts.retrieve_waiter  # no public view of it: the state itself, read
        wait_until(lambda: _running_instance(waiter) == 3, 10, "the await's pass on the waiter thread")
        sink.allow(4)
        honest = e.retrieve_async(2, TOKENS, IDS)  # nothing looked up: its pass prefetches
        assert honest.result(10).retrieved_tokens == ALL and caches_equal(on_disk, dst)
        assert not waiting.done()
        stop = threading.Thread(target=e.close if how == "close" else lambda: e.unregister(3))
        stop.start()
        assert waiting.result(10).retrieved_tokens == 0  # at once, not at its 60 s bound
        stop.join(10)
        assert not stop.is_alive()
    finally:
        sink.allow(4)
        e.close()
