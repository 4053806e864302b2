"""Admission policies: always, second-hit (bounded window), TinyLFU (sketch, doorkeeper, victim)."""

from __future__ import annotations

import pytest

from kvcache.errors import ConfigError
from kvcache.storage.admission import (
    AlwaysAdmit,
    FrequencySketch,
    SecondHitAdmission,
    TinyLFUAdmission,
    create_admission,
)


def test_always_admits_every_store_and_never_promotes_a_hit() -> None:
    p = AlwaysAdmit()
    assert p.on_store(1, None) and p.on_store(1, 2)
    assert not p.on_hit(1, None)


def test_second_hit_admits_on_the_second_sighting_only_once_per_hit() -> None:
    p = SecondHitAdmission(window=8)
    assert not p.on_store(1, None)  # first sighting
    assert p.on_hit(1, None)  # second: written now
    assert not p.on_hit(1, None)  # third: already written, never again
    assert p.on_store(1, None)  # stored again (L1 evicted it): still worth the tier
    assert not p.on_store(2, None) and p.on_store(2, None)  # stored twice


def test_second_hit_forgets_keys_outside_its_window() -> None:
    p = SecondHitAdmission(window=3)
    assert not p.on_store(1, None)
    for k in (2, 3, 4):  # three other keys push key 1 out of a window of 3
        p.on_store(k, None)
    assert not p.on_store(1, None)  # a first sighting again
    assert p.on_store(4, None)  # still in the window


def test_sketch_counts_ages_and_saturates() -> None:
    s = FrequencySketch(16)
    assert s.estimate(7) == 0
    for _ in range(20):
        s.increment(7)
    assert s.estimate(7) == 15  # 4-bit counters saturate
    before = s.estimate(7)
    for k in range(1000, 1000 + s.sample):  # enough other sightings to trigger aging
        s.increment(k)
    assert s.estimate(7) <= before // 2 + 1


def test_sketch_rows_spread_keys() -> None:
    s = FrequencySketch(1 << 12)
    for k in range(200):
        s.increment(k * 0x10001)
    # count-min never under-counts; with 4 rows over 4096 cells few keys over-count
    assert all(s.estimate(k * 0x10001) >= 1 for k in range(200))
    assert sum(s.estimate(k * 0x10001) > 1 for k in range(200)) < 10


def test_tinylfu_doorkeeper_then_frequency_against_the_victim() -> None:
    p = TinyLFUAdmission(window=1 << 10)
    assert not p.on_store(1, None)  # first sighting: never
    assert p.on_store(1, None)  # twice and the tier has room
    for _ in range(5):
        p.on_store(2, None)  # key 2: sighted 5 times
    assert not p.on_store(3, 2) and not p.on_store(3, 2)  # 1, then 2 sightings: not over 5
    for _ in range(4):
        p.on_store(3, 2)
    assert p.on_store(3, 2)  # 7 sightings beat the victim's 5
    assert p.on_hit(9, None) is False and p.on_hit(9, None) is True  # becomes frequent once
    assert p.on_hit(9, None) is False


def test_tinylfu_hit_that_loses_to_the_victim_can_win_on_a_later_hit() -> None:
    p = TinyLFUAdmission(window=1 << 10)
    for _ in range(2):
        p.on_store(50, None)  # the victim: sighted twice
    assert not p.on_store(1, 50)  # first sighting
    assert not p.on_hit(1, 50)  # second: a tie with the victim is not enough
    assert p.on_hit(1, 50)  # third: more frequent, written now
    assert not p.on_hit(1, 50)  # and not again


def test_unknown_policy_and_bad_window_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown L2 admission policy 'lfu'"):
        create_admission("lfu")
    with pytest.raises(ConfigError, match="window"):
        create_admission("second-hit", 0)
    assert isinstance(create_admission("tinylfu", 64), TinyLFUAdmission)
