"""AsyncL2: events, the in-flight bound, back-off and recovery, with real disk and Redis tiers."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.observability.event import EventType, L2LoadFailed, L2StoreFailed
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.base import Announce, L2Adapter, StoreItem, storage_error
from kvcache.storage.l2.disk import DiskL2Adapter
from kvcache.storage.l2.redis.single import RedisL2Adapter
from kvcache.testing.redis_local import LocalRedis
from tests.helpers import RecordingSink as Sink


class GatedDisk(DiskL2Adapter):
    """A real disk tier whose stores wait for a gate: makes "in flight" observable."""

    def __init__(self, path: str) -> None:
        super().__init__(path, 1 << 24)
        self.gate = threading.Event()

    def store(self, key: int, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        self.gate.wait(10)
        return super().store(key, chunk, announce)


def chunk(v: float = 1.0) -> torch.Tensor:
    return torch.full((1, 2, 16, 8), v)


def test_store_load_events_and_callbacks(tmp_path: Path) -> None:
    sink = Sink()
    tier = AsyncL2(DiskL2Adapter(str(tmp_path), 1 << 20), workers=2, bus=sink)
    done: list[bool] = []
    assert tier.submit_store(1, chunk(3.0), done.append)
    assert tier.flush(5) and done == [True]
    out = torch.zeros_like(chunk())
    assert tier.submit_load(1, out, done.append) and tier.submit_load(2, out.clone(), done.append)
    assert tier.flush(5) and sorted(done) == [False, True, True]
    assert torch.all(out == 3.0)
    (st,) = sink.of(EventType.L2_STORE_FINISHED)
    assert st.metadata.backend == "disk" and st.metadata.keys == [1] and st.metadata.duration_s >= 0
    (ld,) = sink.of(EventType.L2_LOAD_FINISHED)
    assert ld.metadata.num_bytes == out.numel() * 4
    assert tier.counters["load_misses"] == 1 and tier.contains([1, 2]) == [True, False]
    tier.close()
    tier.close()
    assert not tier.submit_store(3, chunk(), done.append)


def test_inflight_bound_drops_stores(tmp_path: Path) -> None:
    sink = Sink()
    disk = GatedDisk(str(tmp_path))
    tier = AsyncL2(disk, workers=1, max_inflight=2, bus=sink)
    done: list[bool] = []
    assert tier.submit_store(1, chunk(), done.append)
    assert tier.submit_store(2, chunk(), done.append)
    assert not tier.submit_store(3, chunk(), done.append)  # refused, callback not called
    failed = sink.of(EventType.L2_STORE_FAILED)
    assert failed[-1].metadata == L2StoreFailed(backend="disk", keys=[3], reason="busy")
    assert tier.info()["inflight"]["store"] == 2 and not tier.flush(0.01)
    disk.gate.set()
    assert tier.flush(5) and done == [True, True] and tier.counters["stores_dropped"] == 1
    tier.close()


def test_redis_killed_mid_run_backs_off_and_recovers(redis_server: LocalRedis) -> None:
    sink = Sink()
    now = [0.0]
    adapter = RedisL2Adapter(redis_server.url, socket_timeout_s=0.5, connect_timeout_s=0.5)
    tier = AsyncL2(adapter, workers=2, retry_interval_s=10.0, bus=sink, clock=lambda: now[0])
    done: list[bool] = []
    tier.submit_store(1, chunk(), done.append)
    assert tier.flush(5) and tier.contains([1]) == [True]
    redis_server.stop()
    tier.submit_store(2, chunk(), done.append)
    assert tier.flush(5) and done == [True, False]
    assert sink.of(EventType.L2_STORE_FAILED)[-1].metadata.reason == "unavailable"
    assert not tier.available
    # while backing off: immediate misses / refusals, the adapter is not called
    assert tier.contains([1]) == [False]
    assert not tier.submit_store(3, chunk(), done.append)
    assert not tier.submit_load(1, chunk(), done.append)
    assert tier.counters["store_failures"] == 1 and tier.counters["stores_dropped"] == 1
    now[0] = 11.0  # retry interval passed; server still down -> contains fails, backs off again
    assert tier.contains([1]) == [False] and tier.counters["contains_failures"] == 1
    assert sink.of(EventType.L2_LOAD_FAILED)[-1].metadata.reason == "unavailable"
    redis_server.start()
    now[0] = 22.0
    assert tier.submit_store(4, chunk(), done.append) and tier.flush(5)
    assert tier.contains([4]) == [True] and tier.available
    tier.close()


class Broken(L2Adapter):
    backend = "broken"

    def store(self, key: int, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        raise RuntimeError("boom")

    def load(self, key: int, out: torch.Tensor) -> bool:
        raise OSError("eio")

    def contains(self, keys: Sequence[int]) -> list[bool]:
        return [True] * len(keys)

    def delete(self, keys: Sequence[int]) -> int:
        return 0


def test_unexpected_errors_are_io_failures_without_backoff() -> None:
    sink = Sink()
    tier = AsyncL2(Broken(), bus=sink)
    done: list[bool] = []

    def bad_callback(ok: bool) -> None:
        done.append(ok)
        raise ValueError("callback bug")

    tier.submit_store(1, chunk(), bad_callback)
    tier.submit_load(1, chunk(), done.append)
    assert tier.flush(5) and done == [False, False]
    assert sorted((e.event_type.value, e.metadata.reason) for e in sink.events) == [
        ("l2.load.failed", "io"),
        ("l2.store.failed", "io"),
    ]
    assert tier.available and tier.info()["inflight"] == {"store": 0, "load": 0}
    tier.close()


def test_a_full_disk_warns_once_per_episode_and_every_loss_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Observed before: each write to a full disk logged two warnings, for ever. Every failed
    write is still an event (and a metric); the log says it once until a write succeeds."""
    full = {"on": True}
    real_write = DiskL2Adapter._write

    def write(self: DiskL2Adapter, *args: Any) -> None:
        if full["on"]:  # filled by someone else: evicting our own chunks cannot help
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, *args)

    monkeypatch.setattr(DiskL2Adapter, "_write", write)
    sink = Sink()
    tier = AsyncL2(DiskL2Adapter(str(tmp_path), 1 << 20), workers=1, bus=sink)
    caplog.set_level(logging.WARNING)

    def episode(first_key: int) -> list[logging.LogRecord]:
        caplog.clear()
        for key in range(first_key, first_key + 10):
            assert tier.submit_store(key, chunk(), lambda ok: None, 5)
        assert tier.flush(5)
        return [r for r in caplog.records if r.levelno >= logging.WARNING]

    assert len(episode(0)) == 2  # the tier's "disk is full" and the failed write, once each
    failed = sink.of(EventType.L2_STORE_FAILED)
    assert len(failed) == 10 and {e.metadata.reason for e in failed} == {"full"}
    full["on"] = False
    assert tier.submit_store(100, chunk(), lambda ok: None) and tier.flush(5)
    assert tier.adapter.contains([100]) == [True]
    full["on"] = True
    assert len(episode(200)) == 2  # a new episode is news again
    assert tier.counters["store_failures"] == 20
    tier.close()


class BatchedDisk(DiskL2Adapter):
    """A real disk tier that takes batches (as the Redis tiers do), records their sizes, and
    can hold the first one at a gate; odd keys may fail as if their shard were down."""

    def __init__(self, path: str, max_batch: int, shard_down: bool = False) -> None:
        super().__init__(path, 1 << 24)
        self.max_batch = max_batch
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.shard_down = shard_down

    def store_many(self, items: Sequence[StoreItem]) -> list[int | Exception]:
        self.batches.append(len(items))
        self.gate.wait(10)
        out = super().store_many(items)
        return [self._maybe_down(key, r) for (key, _, _), r in zip(items, out, strict=True)]

    def contains_many(self, keys: Sequence[int]) -> list[bool | Exception]:
        return [self._maybe_down(k, r) for k, r in zip(keys, super().contains_many(keys), strict=True)]

    def _maybe_down(self, key: int, result: Any) -> Any:
        if self.shard_down and key % 2:
            return storage_error(f"shard of {key} is down", "unavailable", "shard")
        return result


def test_queued_work_goes_in_batches_and_batch_events_add_up(tmp_path: Path) -> None:
    sink = Sink()
    disk = BatchedDisk(str(tmp_path), max_batch=4)
    tier = AsyncL2(disk, workers=1, bus=sink)
    done: list[bool] = []
    t0 = time.perf_counter()
    for key in range(10):  # the first batch waits at the gate while the rest queue up
        assert tier.submit_store(key, chunk(), done.append)
    disk.gate.set()
    assert tier.flush(5) and done == [True] * 10
    wall = time.perf_counter() - t0
    *full, last = disk.batches[1:]
    assert sum(disk.batches) == 10 and full and set(full) == {4} and 1 <= last <= 4
    finished = sink.of(EventType.L2_STORE_FINISHED)
    assert sorted(k for e in finished for k in e.metadata.keys) == list(range(10))
    assert sum(e.metadata.duration_s for e in finished) <= wall  # not n x the batch time
    outs = [torch.empty_like(chunk()) for _ in range(3)]
    for key, out in enumerate(outs):
        assert tier.submit_load(key, out, done.append)
    assert tier.flush(5) and done[10:] == [True] * 3 and tier.counters["loads"] == 3
    tier.close()


def test_a_batch_respects_the_byte_bound(tmp_path: Path) -> None:
    disk = BatchedDisk(str(tmp_path), max_batch=8)
    disk.max_batch_bytes = chunk().numel() * 4 * 2  # two chunks
    tier = AsyncL2(disk, workers=1)
    for key in range(7):
        tier.submit_store(key, chunk(), lambda ok: None)
    disk.gate.set()
    assert tier.flush(5) and max(disk.batches) == 2 and sum(disk.batches) == 7
    tier.close()


def test_shard_failures_are_counted_per_key_without_skipping_the_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = Sink()
    disk = BatchedDisk(str(tmp_path), max_batch=16, shard_down=True)
    disk.gate.set()
    tier = AsyncL2(disk, workers=2, bus=sink)
    done: dict[int, bool] = {}
    caplog.set_level(logging.DEBUG, "kvcache.storage.l2.async_front")
    for key in range(8):
        assert tier.submit_store(key, chunk(), lambda ok, k=key: done.__setitem__(k, ok))
    assert tier.flush(5) and done == {k: k % 2 == 0 for k in range(8)}
    failed = sink.of(EventType.L2_STORE_FAILED)
    assert sorted(k for e in failed for k in e.metadata.keys) == [1, 3, 5, 7]
    assert {e.metadata.reason for e in failed} == {"unavailable"}
    assert tier.available  # the other shards still answer
    assert tier.contains([0, 1, 2]) == [True, False, True] and tier.counters["contains_failures"] == 1
    (lookup,) = sink.of(EventType.L2_LOAD_FAILED)
    assert lookup.metadata == L2LoadFailed(backend="disk", keys=[1], reason="unavailable")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the adapter logs shards
    assert tier.submit_store(9, chunk(), lambda ok: None)  # still admitted: no tier back-off
    tier.close()
