"""A copy of the engine's blocks never starts after the client stopped waiting for it.

Observed before: the daemon checked a request's deadline only on arrival. A store that then
waited for L1 room (held by write-through) or a retrieve that waited for L2 loads went on,
after the client had timed out and vLLM had handed the blocks to another request: the late
store cached that request's bytes under the first prompt, the late retrieve overwrote a live
request's KV. Now every wait is bounded by the deadline and a copy past it is refused.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcache.config import EngineConfig
from kvcache.deadline import Deadline
from kvcache.engine import CacheEngine
from kvcache.errors import DeadlineExceededError
from kvcache.layouts import KVFormat
from kvcache.observability.event import Event, EventType
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from tests.helpers import RecordingSink

BS, CS = 16, 32
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
TOKENS = list(range(500, 500 + 8 * BS))  # 4 chunks
IDS = list(range(8))


class _Holding(RecordingSink):
    """Holds the L2 operations whose completion event is ``held`` until ``gate`` is set."""

    def __init__(self, held: EventType) -> None:
        super().__init__()
        self.held = held
        self.gate = threading.Event()

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is self.held:
            self.gate.wait(30)


def _engine(path: Path, sink: _Holding | None, **kw: Any) -> tuple[CacheEngine, Any]:
    caches = make_kv_caches(FMT, num_blocks=8, block_size=BS, seed=1)
    probe = CacheEngine(EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22))
    probe.register(1, "m", caches)
    slot = int(probe.status()["instances"][0]["chunk_bytes"])
    probe.close()
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=4 * slot, l1_extent_bytes=slot,
                       l2_disk_path=str(path), **kw)  # fmt: skip
    e = CacheEngine(cfg, bus=sink)
    e.register(1, "m", caches)
    return e, caches


def test_a_store_waiting_for_l1_room_gives_up_at_the_deadline(tmp_path: Path) -> None:
    sink = _Holding(EventType.L2_STORE_FINISHED)
    e, _ = _engine(tmp_path, sink, store_wait_timeout_s=30.0)
    try:
        assert e.store(1, TOKENS, IDS).stored_chunks == 4  # L1 full, pinned by held writes
        other = [t + 10_000 for t in TOKENS]
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            e.store(1, other, IDS, deadline=Deadline.within(0.3))
        assert time.monotonic() - t0 < 10  # well before the 30 s store wait
    finally:
        sink.gate.set()
    assert e.flush(10)
    assert e.lookup(1, other) == 0  # nothing copied for it
    assert e.store(1, other, IDS).stored_chunks == 4  # and the engine is fine
    e.close()


def test_a_retrieve_waiting_for_l2_loads_leaves_the_blocks_alone_at_the_deadline(tmp_path: Path) -> None:
    writer, _ = _engine(tmp_path, None)
    writer.store(1, TOKENS, IDS)
    assert writer.flush(10)
    writer.close()
    sink = _Holding(EventType.L2_LOAD_FINISHED)
    e, caches = _engine(tmp_path, sink, retrieve_wait_timeout_s=30.0)
    try:
        before = clone_caches(caches)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            e.retrieve(1, TOKENS, IDS, deadline=Deadline.within(0.3))
        assert time.monotonic() - t0 < 10
        assert caches_equal(caches, before)  # no byte moved into the engine's blocks
    finally:
        sink.gate.set()
    assert e.flush(10)
    assert e.retrieve(1, TOKENS, IDS) == len(TOKENS)  # pins were released: it all still works
    e.close()


def test_a_deadline_in_the_past_moves_nothing(tmp_path: Path) -> None:
    e, caches = _engine(tmp_path, None)
    e.store(1, TOKENS, IDS)
    before = clone_caches(caches)
    with pytest.raises(DeadlineExceededError):
        e.retrieve(1, TOKENS, IDS, deadline=Deadline.within(-1))
    with pytest.raises(DeadlineExceededError):
        e.store(1, [t + 1 for t in TOKENS], IDS, deadline=Deadline.within(-1))
    assert caches_equal(caches, before) and e.lookup(1, [t + 1 for t in TOKENS]) == 0
    e.close()
