"""A store that meets chunks an L2 prefetch holds LOADING (``_StoreOp._watch``): the edges
of its watch (the alarm that bounds it, the engine closing, the instance leaving)."""

from __future__ import annotations

import threading
from pathlib import Path

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.observability.event import Event, EventType
from kvcache.records import StoreResult
from tests.engine.test_engine_l2 import IDS, TOKENS, _HoldingFailedLoads, engine, reg
from tests.helpers import RecordingSink as Sink

OTHER = [t + 7_000 for t in TOKENS]


class _HoldingEviction(Sink):
    """Once ``armed``, holds the first ``L1_KEYS_EVICTED`` inside its publication until
    ``gate`` is set. ``L1Pool.begin_load`` publishes it after its LOADING entries were made
    and before the prefetch hands them to the tier: they stay LOADING, deterministically,
    with nothing in flight in the tier."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = threading.Event()
        self.held = threading.Event()
        self.gate = threading.Event()

    def publish(self, event: Event) -> None:
        super().publish(event)
        if event.event_type is EventType.L1_KEYS_EVICTED and self.armed.is_set() and not self.held.is_set():
            self.held.set()
            self.gate.wait(10)


def test_a_store_meeting_a_load_after_the_engine_closed_does_not_deadlock(tmp_path: Path) -> None:
    """Observed: a store that met a LOADING chunk once ``close`` had run (a daemon worker
    still serving past the drain timeout, a prefetch of a lookup racing ``close``) hung its
    caller's thread for good: ``_watch`` set its alarm holding the store's lock, and the
    closed ``Alarms`` runs the callback (``_stop_watching``, which takes that lock) at once."""
    with engine(l2_disk_path=str(tmp_path)) as writer:
        reg(writer, 1, seed=1)
        writer.store(1, TOKENS, IDS)
        assert writer.flush(5)
        slot = int(writer.status()["instances"][0]["chunk_bytes"])
    sink = _HoldingEviction()  # below: an L1 of exactly one prompt (4 chunks), one slot per extent
    cfg = EngineConfig(chunk_size=32, l1_size_bytes=4 * slot, l1_extent_bytes=slot,
                       l2_disk_path=str(tmp_path))  # fmt: skip
    e = CacheEngine(cfg, bus=sink)
    try:
        reg(e, 1, seed=1)
        assert e.store(1, OTHER, IDS).stored_chunks == 4  # L1 is full of it: a prefetch evicts
        assert e.flush(5)
        sink.armed.set()
        lookup = threading.Thread(target=e.lookup, args=(1, TOKENS), daemon=True)
        lookup.start()
        assert sink.held.wait(10)  # TOKENS' first chunk LOADING, not yet handed to the disk tier
        e.close()
        results: list[StoreResult | BaseException] = []

        def store() -> None:
            try:
                results.append(e.store(1, TOKENS, IDS))
            except BaseException as err:  # reported below
                results.append(err)

        storer = threading.Thread(target=store, daemon=True)  # daemon: a hang must not hang pytest
        storer.start()
        storer.join(5)
        sink.gate.set()  # the prefetch finds the tier closed and drops its entries
        lookup.join(5)
        storer.join(5)
        assert not storer.is_alive(), "the store deadlocked on its own lock"
        assert len(results) == 1 and isinstance(results[0], StoreResult), results
        r = results[0]
        assert r.stored_chunks + r.skipped_chunks + r.failed_chunks == 4
    finally:
        sink.gate.set()
        e.close()


def test_a_store_that_watched_a_load_does_not_resolve_on_the_tiers_io_thread(tmp_path: Path) -> None:
    """Observed: a store whose last open part was a load it watched resolved on the L2 I/O
    thread that completed the load (``AsyncL2``: its callbacks must be quick), so its
    done-callbacks ran there, holding that load in flight: a callback that flushed the
    engine (wait for L2 writes and loads) waited for its own thread, until its timeout (with
    none, for good). Such a store now resolves on the engine's alarms thread, behind no wait;
    a done-callback there that calls the synchronous ``store`` is refused, as on the other
    engine threads, instead of holding every other store's alarm."""
    with engine(l2_disk_path=str(tmp_path)) as writer:
        reg(writer, 1, seed=1)
        writer.store(1, TOKENS, IDS)
        assert writer.flush(5)
    sink = _HoldingFailedLoads(EventType.L2_LOAD_FINISHED, first_only=True)  # the first load, which succeeds
    with engine(sink, l2_disk_path=str(tmp_path)) as e:
        try:
            reg(e, 2, seed=1)
            assert e.lookup(2, TOKENS) == len(TOKENS)
            assert sink.held.wait(10)  # the loads are in flight, their entries LOADING
            stored = e.store_async(2, TOKENS, IDS)
            flushed: list[bool] = []
            stored.add_done_callback(lambda _f: flushed.append(e.flush(2)))
            refused: list[str] = []
            tried = threading.Event()

            def store_again(_f: object) -> None:
                try:
                    e.store(2, OTHER, IDS)
                except RuntimeError:
                    refused.append(threading.current_thread().name)
                finally:
                    tried.set()

            stored.add_done_callback(store_again)
            assert not stored.done()  # it watches the loads
            sink.gate.set()
            r = stored.result(10)
            assert (r.stored_chunks, r.skipped_chunks, r.failed_chunks) == (0, 4, 0)
            assert e.flush(5)
            assert flushed == [True]
            assert tried.wait(10) and refused == ["kvcache-alarms"]
        finally:
            sink.gate.set()
