"""L2 admission through the engine: what a store writes, what a hit promotes, what is declined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.errors import ConfigError
from kvcache.layouts import KVFormat
from kvcache.observability.event import EventType
from kvcache.testing import caches_equal, make_kv_caches
from tests.helpers import RecordingSink as Sink

BS, CS = 16, 32
FMT = KVFormat.NL_X_NB_TWO_BS_NH_HS
TOKENS = list(range(500, 500 + 8 * BS))  # 4 chunks
IDS = list(range(8))


def engine(sink: Sink | None = None, **kw: Any) -> CacheEngine:
    cfg = EngineConfig(chunk_size=CS, l1_size_bytes=1 << 22, l1_extent_bytes=1 << 16, **kw)
    return CacheEngine(cfg, bus=sink)


def reg(e: CacheEngine, iid: int, seed: int) -> Any:
    caches = make_kv_caches(FMT, num_blocks=8, block_size=BS, seed=seed)
    e.register(iid, "m", caches)
    return caches


def disk_chunks(e: CacheEngine) -> int:
    assert e.flush(10)
    n: int = e.status()["l2"][0]["num_chunks"]
    return n


def test_always_writes_every_stored_chunk(tmp_path: Path) -> None:
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path)) as e:
        reg(e, 1, seed=1)
        e.store(1, TOKENS, IDS)
        assert disk_chunks(e) == 4
        assert not sink.of(EventType.L2_STORE_DECLINED)
        assert e.status()["l2"][0]["admission"] == "always"


@pytest.mark.parametrize("policy", ["second-hit", "tinylfu"])
def test_a_chunk_stored_once_stays_off_disk_until_it_is_hit(tmp_path: Path, policy: str) -> None:
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path), l2_disk_admission=policy) as a:
        src = reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
        assert disk_chunks(a) == 0  # one sighting: nothing written
        (declined,) = sink.of(EventType.L2_STORE_DECLINED)
        assert declined.metadata.backend == "disk" and declined.metadata.policy == policy
        assert len(declined.metadata.keys) == 4 and declined.metadata.num_bytes > 0
        reg(a, 2, seed=2)
        assert a.retrieve(2, TOKENS, IDS) == 128  # the second sighting: an L1 hit
        assert disk_chunks(a) == 4
        assert a.retrieve(2, TOKENS, IDS) == 128  # a third: nothing new to write
        assert disk_chunks(a) == 4
        stored = sum(len(ev.metadata.keys) for ev in sink.of(EventType.L2_STORE_FINISHED))
        assert stored == 4
    with engine(l2_disk_path=str(tmp_path), l2_disk_admission=policy) as b:  # promoted = durable
        dst = reg(b, 3, seed=3)
        assert b.retrieve(3, TOKENS, IDS) == 128 and caches_equal(src, dst)


def test_second_hit_writes_a_chunk_stored_twice(tmp_path: Path) -> None:
    with engine(l2_disk_path=str(tmp_path), l2_disk_admission="second-hit") as e:
        reg(e, 1, seed=1)
        e.store(1, TOKENS, IDS)
        assert disk_chunks(e) == 0
        e._pool.clear()  # L1 lost them; the next store is their second sighting
        e.store(1, TOKENS, IDS)
        assert disk_chunks(e) == 4


def test_s3fifo_l1_serves_what_it_stored() -> None:
    with engine(l1_eviction="s3fifo") as e:
        src = reg(e, 1, seed=1)
        e.store(1, TOKENS, IDS)
        dst = reg(e, 2, seed=2)
        assert e.retrieve(2, TOKENS, IDS) == 128 and caches_equal(src, dst)
        assert e.status()["l1"]["evictable_chunks"] == 4


def test_a_bad_admission_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="l2_disk_admission must be one of"):
        EngineConfig(l2_disk_admission="often")
    with pytest.raises(ConfigError, match="l2_admission_window"):
        EngineConfig(l2_admission_window=0)


def test_each_tier_has_its_own_policy_disk_always_redis_second_hit(tmp_path: Path, redis_server: Any) -> None:
    """Disk takes every chunk at its store; Redis, shared by hosts, only on a hit: a second
    engine on the same Redis finds nothing until the first engine's chunks were read."""
    kw = {"l2_redis_url": redis_server.url, "l2_redis_key_prefix": "adm:", "l2_redis_admission": "second-hit"}
    sink = Sink()
    with engine(sink, l2_disk_path=str(tmp_path), **kw) as a:
        src = reg(a, 1, seed=1)
        a.store(1, TOKENS, IDS)
        assert a.flush(10)
        disk, redis = a.status()["l2"]
        assert (disk["num_chunks"], disk["admission"], redis["admission"]) == (4, "always", "second-hit")
        (declined,) = sink.of(EventType.L2_STORE_DECLINED)
        assert declined.metadata.backend == "redis" and len(declined.metadata.keys) == 4
        with engine(**kw) as b:  # Redis only: nothing there yet
            reg(b, 2, seed=2)
            assert b.lookup(2, TOKENS) == 0
        reg(a, 3, seed=3)
        assert a.retrieve(3, TOKENS, IDS) == 128  # the hit that promotes them to Redis
        assert a.flush(10)
    with engine(**kw) as c:
        dst = reg(c, 4, seed=4)
        assert c.retrieve(4, TOKENS, IDS) == 128 and caches_equal(src, dst)
