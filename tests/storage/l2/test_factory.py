"""The lazy registry: names resolve, unknown names fail clearly, duplicates are refused."""

from __future__ import annotations

import pytest

from kvcache.config import EVICTION_NAMES, EngineConfig
from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l1.s3fifo import S3FIFOPolicy
from kvcache.storage.l2.factory import EVICTION_POLICIES, L2_ADAPTERS, create_policy, l2_adapters_from_config
from tests.helpers import RecordingSink


def test_names_and_lazy_load() -> None:
    assert L2_ADAPTERS.names() == ["disk", "redis", "redis-cluster"]
    assert isinstance(create_policy("lru"), LRUPolicy)
    assert isinstance(create_policy("s3fifo"), S3FIFOPolicy)
    assert tuple(EVICTION_POLICIES.names()) == tuple(sorted(EVICTION_NAMES))  # the flags' choices
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'"):
        create_policy("arc")
    with pytest.raises(ValueError, match="already registered"):
        EVICTION_POLICIES.register("lru", "x", "y")


def test_from_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert l2_adapters_from_config(EngineConfig(), bus=None) == []  # type: ignore[arg-type]
    tiers = l2_adapters_from_config(
        EngineConfig(l2_disk_path=str(tmp_path), l2_redis_url="redis://127.0.0.1:1/0"),
        bus=None,  # type: ignore[arg-type]
    )
    assert [t.backend for t in tiers] == ["disk", "redis"]
    for t in tiers:
        t.close()


def test_a_cluster_url_picks_the_cluster_tier_without_connecting() -> None:
    cfg = EngineConfig(l2_redis_url="redis+cluster://127.0.0.1:1,127.0.0.1:2", l2_retry_interval_s=0.5)
    (tier,) = l2_adapters_from_config(cfg, bus=None)  # type: ignore[arg-type]
    assert tier.backend == "redis-cluster" and tier.shards.retry_s == 0.5  # type: ignore[attr-defined]
    assert tier.info()["masters"] == []  # lazy: nothing reached yet
    tier.close()
    (tier,) = l2_adapters_from_config(cfg, bus=RecordingSink())
    assert tier.info()["evictions_watched"] == {}  # given the bus: watching, once masters answer
    tier.close()
