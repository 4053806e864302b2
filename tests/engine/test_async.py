"""store_async / retrieve_async: many copies in flight, chunks visible only once copied,
completion in submission order, errors on the future with nothing written, deadlines on
queued copies, close() with copies in flight, and offload figures from one source.

Copies are held by a gate in the context's transfer handler (an event per copy, never a
sleep), so every "in flight" state below is a state the test set up, not a race it won.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcache.context
from kvcache import _native
from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine, StoreResult
from kvcache.errors import (
    BlockIdError,
    CudaUnavailableError,
    DeadlineExceededError,
    TransferError,
    UnknownInstanceError,
)
from kvcache.layouts import KVCaches, KVFormat
from kvcache.observability.event import EventType
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.transfer.cpu import CpuTransferHandler, native_cpu_copy
from kvcache.transfer.validate import CheckedJob
from tests.helpers import RecordingSink, counts

BS, CS = 16, 32
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
PROMPT_BLOCKS = 8  # 128 tokens = 4 chunks
PROMPTS = 4
NB = PROMPT_BLOCKS * PROMPTS


def prompt(p: int) -> list[int]:
    return [p * 100_000 + t for t in range(PROMPT_BLOCKS * BS)]


def blocks(p: int) -> list[int]:
    return list(range(p * PROMPT_BLOCKS, (p + 1) * PROMPT_BLOCKS))


def first_blocks(kv: KVCaches) -> list[bytes]:
    """The bytes of blocks ``0..PROMPT_BLOCKS`` of every layer (FMT: ``[2, NB, BS, NH, HS]``)."""
    assert isinstance(kv, list)
    return [t[:, :PROMPT_BLOCKS].contiguous().view(torch.uint8).numpy().tobytes() for t in kv]


class CopyGate:
    """The handler's copy function: each copy waits for its own ``allow``; ``fail_next``
    makes the next copy raise instead (a device fault)."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self._allowed = threading.Semaphore(0)
        self._fail = 0
        self._lock = threading.Lock()

    def __call__(self, table: _native.PageTable, job: CheckedJob, num_threads: int) -> None:
        self.started.release()
        self._allowed.acquire()
        with self._lock:
            fail, self._fail = self._fail > 0, max(0, self._fail - 1)
        if fail:
            raise RuntimeError("injected copy fault")
        native_cpu_copy(table, job, num_threads)

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self._allowed.release()

    def fail_next(self) -> None:
        with self._lock:
            self._fail += 1

    def wait_started(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.started.acquire(timeout=30)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyGate]:
    """Every context registered during the test copies through the gate."""
    g = CopyGate()
    monkeypatch.setattr(kvcache.context, "CpuTransferHandler", functools.partial(CpuTransferHandler, copy=g))
    yield g
    g.allow(1000)  # never leave a worker parked


def make_engine(sink: RecordingSink | None = None, **kw: Any) -> tuple[CacheEngine, KVCaches]:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l1_extent_bytes=1 << 16, **kw)
    e = CacheEngine(cfg, bus=sink)
    caches = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=1)
    e.register(1, "m", caches)
    return e, caches


def test_many_stores_in_flight_become_visible_only_when_their_copies_finish(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, caches = make_engine(sink)
    futures = [e.store_async(1, prompt(p), blocks(p), request_id=f"r{p}") for p in range(PROMPTS)]
    gate.wait_started()  # the first copy is running; the others are queued behind it
    assert not any(f.done() for f in futures)
    assert all(e.lookup(1, prompt(p)) == 0 for p in range(PROMPTS))  # reserved, not visible
    assert not sink.of(EventType.MP_STORE_END) and not sink.of(EventType.L1_WRITE_FINISHED)
    for p in range(PROMPTS):
        gate.allow()
        assert counts(futures[p].result(30)) == (4, 0, 0, 4 * CS)
        ends = sink.of(EventType.MP_STORE_END)
        assert [ev.session_id for ev in ends] == [f"r{q}" for q in range(p + 1)]  # before resolving
        assert e.lookup(1, prompt(p)) == 4 * CS
        if p + 1 < PROMPTS:
            assert e.lookup(1, prompt(p + 1)) == 0  # its copy is still held
    dst = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=2)
    e.register(2, "m", dst)
    gate.allow(PROMPTS)
    for p in range(PROMPTS):
        assert e.retrieve(2, prompt(p), blocks(p)) == 4 * CS
    assert caches_equal(dst, caches)  # every byte landed where it belongs
    e.close()


def test_completions_follow_submission_order_and_a_store_reads_before_a_later_retrieve_writes(
    gate: CopyGate,
) -> None:
    e, caches = make_engine()
    gate.allow()
    e.store(1, prompt(1), blocks(1))  # prompt 1 is cached, from blocks 8..15
    original = clone_caches(caches)
    order: list[str] = []
    store0 = e.store_async(1, prompt(0), blocks(0))  # reads blocks 0..7 ...
    load1 = e.retrieve_async(1, prompt(1), blocks(0))  # ... which this one overwrites
    store2 = e.store_async(1, prompt(2), blocks(2))
    for name, f in (("store0", store0), ("load1", load1), ("store2", store2)):
        f.add_done_callback(lambda _f, name=name: order.append(name))  # type: ignore[misc]
    gate.allow(3)
    assert store0.result(30).stored_chunks == 4 and load1.result(30).retrieved_tokens == 4 * CS
    assert store2.result(30).stored_chunks == 4
    assert order == ["store0", "load1", "store2"]
    dst = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=3)
    e.register(2, "m", dst)
    gate.allow()
    assert e.retrieve(2, prompt(0), blocks(0)) == 4 * CS
    assert first_blocks(dst) == first_blocks(original)  # the store read before the load wrote
    e.close()


def test_errors_reach_the_future_with_nothing_written_and_slots_freed(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, caches = make_engine(sink)
    bad = e.store_async(1, prompt(0), [*blocks(0)[:-1], NB + 5])
    assert isinstance(bad.exception(0), BlockIdError)
    assert isinstance(e.store_async(9, prompt(0), blocks(0)).exception(0), UnknownInstanceError)
    assert isinstance(e.retrieve_async(1, prompt(0), [0, -1] * 4).exception(0), BlockIdError)
    assert not sink.events  # refused before anything was reserved or published

    gate.fail_next()
    failing = e.store_async(1, prompt(0), blocks(0))
    gate.allow()
    with pytest.raises(TransferError, match="injected"):
        failing.result(30)
    assert e.lookup(1, prompt(0)) == 0
    assert e.status()["l1"]["num_chunks"] == 0 and e.status()["l1"]["used_bytes"] == 0
    (end,) = sink.of(EventType.MP_STORE_END)
    assert not end.metadata.success and end.metadata.num_bytes == 0
    assert end.metadata.failed_chunks == 4
    assert e.stats_snapshot().store.ops == 0

    gate.allow()
    assert e.store(1, prompt(0), blocks(0)).stored_chunks == 4  # the engine is fine
    before = clone_caches(caches)
    gate.fail_next()
    gate.allow()
    with pytest.raises(TransferError):
        e.retrieve(1, prompt(0), blocks(1))
    assert caches_equal(caches, before)  # the failed load wrote nothing into the blocks
    assert e.status()["l1"]["pinned_chunks"] == 0  # its pins were released
    e.close()


def test_a_copy_queued_past_its_deadline_never_starts(gate: CopyGate) -> None:
    e, caches = make_engine()
    held = e.store_async(1, prompt(0), blocks(0))
    gate.wait_started()
    deadline = Deadline.within(0.05)
    late_store = e.store_async(1, prompt(1), blocks(1), deadline=deadline)
    # Nothing cached yet: answered on this thread, before its deadline (a wider one: on a loaded
    # machine 50 ms can pass before the call reaches its copy, which then fails as late).
    load_deadline = Deadline.within(0.5)
    late_load = e.retrieve_async(1, prompt(0), blocks(2), deadline=load_deadline)
    before = clone_caches(caches)
    while not load_deadline.passed():  # a moment of time: no event marks it
        time.sleep(0.01)
    gate.allow(3)
    assert held.result(30).stored_chunks == 4
    with pytest.raises(DeadlineExceededError):
        late_store.result(30)
    assert late_load.result(30).retrieved_tokens == 0  # it found nothing to copy, so nothing was late
    assert e.lookup(1, prompt(1)) == 0 and e.status()["l1"]["num_chunks"] == 4
    assert caches_equal(caches, before)
    e.close()


def test_close_completes_the_copies_in_flight(gate: CopyGate, tmp_path: Path) -> None:
    e, _ = make_engine(l2_disk_path=str(tmp_path))
    futures = [e.store_async(1, prompt(p), blocks(p)) for p in range(PROMPTS)]
    gate.wait_started()
    closer = threading.Thread(target=e.close)
    closer.start()
    assert not any(f.done() for f in futures)
    gate.allow(PROMPTS)
    closer.join(30)
    assert not closer.is_alive()
    assert all(f.done() and f.result().stored_chunks == 4 for f in futures)  # before close returned
    fresh, _ = make_engine(l2_disk_path=str(tmp_path))  # written through before the tiers closed
    gate.allow(10)
    assert all(fresh.lookup(1, prompt(p)) == 4 * CS for p in range(PROMPTS))
    fresh.close()


def test_offload_figures_come_from_the_transfer_results_alone(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, _ = make_engine(sink)
    gate.allow(10)
    futures: list[Future[Any]] = [e.store_async(1, prompt(p), blocks(p)) for p in range(2)]
    results = [f.result(30) for f in futures]
    assert [r.stored_chunks for r in results] == [4, 4]
    again = e.store(1, prompt(0), blocks(0))
    assert again.skipped_chunks == 4 and again.num_bytes == 0  # no copy: no figures
    loaded = e.retrieve_async(1, prompt(1), blocks(3), skip_tokens=BS).result(30)
    assert loaded.retrieved_tokens == 4 * CS
    stats = e.stats_snapshot()
    stores, loads = sink.of(EventType.MP_STORE_END), sink.of(EventType.MP_RETRIEVE_END)
    chunk_bytes = e.status()["instances"][0]["chunk_bytes"]
    assert stats.store.bytes == sum(ev.metadata.num_bytes for ev in stores) == 8 * chunk_bytes
    assert [r.num_bytes for r in results] == [4 * chunk_bytes] * 2  # the callers see the same figures
    assert stats.store.seconds == pytest.approx(sum(ev.metadata.transfer_seconds for ev in stores))
    assert stats.store.seconds == pytest.approx(sum(r.transfer_seconds for r in results))
    assert stats.store.ops == 2 and stats.store.tokens == 8 * CS
    assert stats.retrieve.bytes == loads[0].metadata.num_bytes == 4 * chunk_bytes - chunk_bytes // 2
    assert loaded.num_bytes == stats.retrieve.bytes and loaded.transfer_seconds == stats.retrieve.seconds > 0
    assert stats.retrieve.seconds == pytest.approx(loads[0].metadata.transfer_seconds)
    assert stats.retrieve.tokens == 4 * CS - BS
    e.close()


def test_a_done_callback_may_submit_but_not_wait(gate: CopyGate) -> None:
    """Done-callbacks run on the instance's completer thread: a blocking store there would
    wait for a completion queued behind itself, so it is refused; store_async is fine."""
    e, _ = make_engine()
    seen: list[object] = []
    chained: list[Future[StoreResult]] = []
    returned = threading.Event()

    def callback(_f: Future[StoreResult]) -> None:
        try:
            e.store(1, prompt(1), blocks(1))
        except RuntimeError as err:
            seen.append(err)
        chained.append(e.store_async(1, prompt(2), blocks(2)))
        returned.set()

    first = e.store_async(1, prompt(0), blocks(0))
    first.add_done_callback(callback)  # the copy is held: the callback runs on the completer
    gate.allow(10)
    assert returned.wait(30)  # (a result() alone may return before its callbacks ran)
    assert len(seen) == 1 and "done-callback" in str(seen[0])
    assert chained[0].result(30).stored_chunks == 4
    e.close()


def test_unregister_completes_the_instances_copies_first(gate: CopyGate) -> None:
    sink = RecordingSink()
    e, _ = make_engine(sink)
    future = e.store_async(1, prompt(0), blocks(0))
    gate.wait_started()
    leaving = threading.Thread(target=e.unregister, args=(1,))
    leaving.start()
    assert not future.done()
    gate.allow()
    leaving.join(30)
    assert not leaving.is_alive() and future.result(0).stored_chunks == 4
    kinds = [ev.event_type for ev in sink.events]
    assert kinds.index(EventType.MP_STORE_END) < kinds.index(EventType.INSTANCE_UNREGISTERED)
    e.close()


def test_a_store_naming_a_device_event_on_a_cpu_cache_fails_with_nothing_stored(gate: CopyGate) -> None:
    """``after`` orders the copies after the engine's GPU work; a CPU cache cannot, so the
    store fails typed rather than copy blocks the engine may still be writing."""
    sink = RecordingSink()
    e, _ = make_engine(sink)
    gate.allow(10)
    failed = e.store_async(1, prompt(0), blocks(0), after=object())
    assert isinstance(failed.exception(30), CudaUnavailableError)
    assert e.lookup(1, prompt(0)) == 0 and e.status()["l1"]["num_chunks"] == 0
    (end,) = sink.of(EventType.MP_STORE_END)
    assert not end.metadata.success and end.metadata.failed_chunks == 4
    assert e.store(1, prompt(0), blocks(0)).stored_chunks == 4  # without the event: fine
    e.close()


@pytest.mark.cuda
def test_a_store_after_the_engines_event_stores_what_the_engine_wrote() -> None:
    """A CUDA cache written on the engine's own stream behind a slow kernel: ``store`` with
    the event recorded after the write (and no host synchronisation) stores the written
    bytes; a retrieve into other blocks brings exactly those back."""
    e = CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22))
    caches = make_kv_caches(FMT, num_blocks=NB, block_size=BS, seed=1, device="cuda")
    e.register(1, "m", caches)
    assert isinstance(caches, list)
    fresh = [torch.randn_like(t) for t in caches]
    writer = torch.cuda.Stream(device=caches[0].device)
    writer.wait_stream(torch.cuda.current_stream(caches[0].device))
    written = torch.cuda.Event()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(400_000_000)  # the write lands long after the store is submitted
        for t, f in zip(caches, fresh, strict=True):
            t.copy_(f)
        written.record(writer)
    assert e.store(1, prompt(0), blocks(0), after=written).stored_chunks == 4
    torch.cuda.synchronize()
    assert e.retrieve(1, prompt(0), blocks(1)) == 4 * CS
    torch.cuda.synchronize()
    for t, f in zip(caches, fresh, strict=True):
        got = t[:, PROMPT_BLOCKS : 2 * PROMPT_BLOCKS].contiguous().view(torch.uint8)
        assert torch.equal(got, f[:, :PROMPT_BLOCKS].contiguous().view(torch.uint8))
    e.close()
