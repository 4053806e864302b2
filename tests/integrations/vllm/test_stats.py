"""The connector's per-interval statistics: deltas, merged across workers, weighted by tokens."""

from __future__ import annotations

import pickle
import threading

import pytest

from kvcache.integrations.vllm.stats import COUNTERS, ConnectorTally, merge, summarize


def test_each_interval_is_a_delta_and_totals_add_up_once() -> None:
    tally = ConnectorTally()
    tally.transfer("load", tokens=256, nbytes=1 << 20, seconds=0.01)
    first = tally.take()
    assert first["load_tokens"] == 256 and first["load_sizes"] == [float(1 << 20)]
    assert tally.take() == {}  # nothing happened since
    tally.transfer("load", tokens=512, nbytes=2 << 20, seconds=0.03)
    tally.transfer("store", tokens=0, nbytes=0, seconds=0.5, ok=False)
    second = tally.take()
    total = merge(merge({}, first), second)
    assert total["load_tokens"] == 768 and total["load_bytes"] == 3 << 20
    assert total["load_sizes"] == [float(1 << 20), float(2 << 20)]
    assert total["store_failures"] == 1 and "store_ops" not in total
    assert total["store_seconds"] == 0.5  # a failed store still took its time
    tally.transfer("load", tokens=64, nbytes=1 << 18, seconds=0.01, ok=False)  # fell short
    short = tally.take()
    assert short["load_tokens"] == 64 and short["load_bytes"] == 1 << 18 and short["load_failures"] == 1
    assert "load_ops" not in short and short["load_sizes"] == [float(1 << 18)]  # sizes sum to bytes


def test_workers_merge_and_the_payload_survives_a_process_boundary() -> None:
    workers = [ConnectorTally() for _ in range(4)]  # tensor-parallel ranks
    for rank, w in enumerate(workers):
        w.transfer("store", tokens=256, nbytes=1000 * (rank + 1), seconds=0.001)
    merged: dict = {}
    for w in workers:
        merge(merged, pickle.loads(pickle.dumps(w.take())))
    assert merged["store_ops"] == 4 and merged["store_bytes"] == 10_000
    assert sorted(merged["store_sizes"]) == [1000.0, 2000.0, 3000.0, 4000.0]


def test_averages_are_token_weighted_not_a_mean_of_rates() -> None:
    tally = ConnectorTally()
    tally.transfer("load", tokens=16, nbytes=16, seconds=0.016)  # 1 ms/token, a tiny load
    tally.transfer("load", tokens=1024, nbytes=1024, seconds=0.1024)  # 0.1 ms/token
    out = summarize(tally.take())
    # sum(seconds) / sum(tokens) = 0.1184 / 1040 s; a mean of rates would say 0.55 ms/token.
    assert out["load_ms_per_1k_tokens"] == pytest.approx(1e6 * 0.1184 / 1040)


def test_lookups_split_hits_by_tier_and_unknown_counters_are_refused() -> None:
    tally = ConnectorTally()
    tally.lookup(tokens=1000, hit_tokens=768, l2_tokens=256)
    tally.count("requests_not_cached")
    with pytest.raises(KeyError):
        tally.count("load_failure")  # a typo must not become a silent new series
    data = tally.take()
    assert (data["lookup_hit_tokens_l1"], data["lookup_hit_tokens_l2"]) == (512, 256)
    assert summarize(data)["lookup_hit_rate"] == pytest.approx(0.768)
    assert set(k for k in data if not isinstance(data[k], list)) <= set(COUNTERS)


def test_concurrent_counting_loses_nothing() -> None:
    tally = ConnectorTally()
    taken: list = []

    def work() -> None:
        for _ in range(2000):
            tally.transfer("store", tokens=1, nbytes=1, seconds=0.0)

    def drain() -> None:
        for _ in range(200):
            taken.append(tally.take())

    threads = [threading.Thread(target=work) for _ in range(3)] + [threading.Thread(target=drain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total: dict = {}
    for d in [*taken, tally.take()]:
        merge(total, d)
    assert total["store_tokens"] == 6000 and len(total["store_sizes"]) == 6000


def test_totals_survive_takes() -> None:
    tally = ConnectorTally()
    tally.count("load_failures")
    tally.take()
    tally.count("load_failures", 2)
    assert tally.totals()["load_failures"] == 3 and tally.take()["load_failures"] == 2
