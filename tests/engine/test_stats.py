"""Offload stats: token-weighted averages, zero safety, snapshot-and-reset deltas, aggregation."""

from __future__ import annotations

import json
import threading

import pytest

from kvcache.engine.stats import SIZE_BUCKETS_BYTES, OffloadStats, OffloadStatsCollector, TransferStats


def test_average_is_sum_over_sum_not_mean_of_rates() -> None:
    c = OffloadStatsCollector()
    c.record_store(1000, 1.0, 100)  # 10 ms / token
    c.record_store(10, 0.01, 1)  # 10 ms / token
    c.record_store(9000, 0.09, 900)  # 0.1 ms / token
    s = c.snapshot()
    assert s.avg_store_seconds_per_token == pytest.approx(1.1 / 1001)
    mean_of_rates = (0.01 + 0.01 + 0.0001) / 3
    assert s.avg_store_seconds_per_token != pytest.approx(mean_of_rates)
    assert (s.store.ops, s.store.tokens, s.store.bytes) == (3, 1001, 10010)
    assert s.store.bytes_per_second == pytest.approx(10010 / 1.1)


def test_zero_safe() -> None:
    s = OffloadStats()
    assert s.avg_retrieve_seconds_per_token == 0.0 and s.avg_store_seconds_per_token == 0.0
    assert s.lookup_hit_rate == 0.0 and s.retrieve.bytes_per_second == 0.0 and s.is_empty()
    c = OffloadStatsCollector()
    c.record_retrieve(0, 0.5, 0)  # moved nothing: not an operation
    assert c.snapshot().retrieve.ops == 0


def test_snapshot_is_a_delta_without_double_counting() -> None:
    c = OffloadStatsCollector()
    c.record_store(100, 0.1, 10)
    c.record_lookup(512, 256)
    first = c.snapshot()
    assert (first.store.ops, first.lookups, first.lookup_hit_rate) == (1, 1, 0.5)
    assert c.snapshot().is_empty()
    c.record_retrieve(50, 0.2, 5)
    third = c.snapshot()
    assert third.store.ops == 0 and third.retrieve.ops == 1 and third.lookups == 0
    total = OffloadStats.aggregate([first, third])
    assert total.store.bytes == 100 and total.retrieve.bytes == 50 and total.lookups == 1


def test_aggregate_across_workers_keeps_weighting() -> None:
    workers = []
    for ops in ([(10, 1.0, 1000)], [(10, 1.0, 10), (10, 1.0, 10)]):
        c = OffloadStatsCollector()
        for nbytes, sec, tok in ops:
            c.record_retrieve(nbytes, sec, tok)
        workers.append(c.snapshot())
    total = OffloadStats.aggregate(workers)
    assert total.retrieve.ops == 3 and total.retrieve.tokens == 1020
    assert total.avg_retrieve_seconds_per_token == pytest.approx(3.0 / 1020)
    assert OffloadStats.aggregate([]).is_empty()


def test_size_histogram_buckets() -> None:
    t = TransferStats()
    for nbytes in (1, 4096, 4097, 1 << 40):
        t.record(nbytes, 0.0, 1)
    assert len(t.size_hist) == len(SIZE_BUCKETS_BYTES) + 1
    assert t.size_hist[0] == 2 and t.size_hist[1] == 1 and t.size_hist[-1] == 1
    assert list(SIZE_BUCKETS_BYTES) == sorted(SIZE_BUCKETS_BYTES)


def test_dict_round_trip_is_json() -> None:
    c = OffloadStatsCollector()
    c.record_store(123, 0.5, 7)
    c.record_lookup(10, 3)
    s = c.snapshot()
    back = OffloadStats.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    with pytest.raises(ValueError):
        TransferStats.from_dict({"bytes": 0, "seconds": 0, "ops": 0, "tokens": 0, "size_hist": [1]})


def test_collector_is_thread_safe() -> None:
    c = OffloadStatsCollector()
    seen: list[OffloadStats] = []

    def work() -> None:
        for _ in range(2000):
            c.record_store(1, 0.001, 1)
        seen.append(c.snapshot())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = OffloadStats.aggregate([*seen, c.snapshot()])
    assert total.store.ops == 8000 and total.store.tokens == 8000
