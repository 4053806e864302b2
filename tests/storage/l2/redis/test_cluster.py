"""The Redis Cluster L2 against a real 3-master + 3-replica cluster on loopback: sharding,
pipelined batches, redirections, corruption, and a master SIGKILLed mid-run."""

from __future__ import annotations

import logging
import shutil
import uuid

import pytest
import redis
import torch
from redis.crc import key_slot

from kvcache.errors import CorruptChunkError, ForgedRecordError, StorageError
from kvcache.observability.event import EventType
from kvcache.storage.l2 import codec
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.base import failure_reason, failure_scope
from kvcache.storage.l2.redis.cluster import RedisClusterL2Adapter, ShardHealth
from kvcache.storage.l2.redis.seal import RecordSeal
from kvcache.storage.l2.redis.single import chunk_name
from kvcache.testing import random_fill
from kvcache.testing.redis_cluster_local import LocalRedisCluster, wait_until
from tests.helpers import RecordingSink, start_cluster


def chunk(seed: int) -> torch.Tensor:
    """A chunk of random bytes (NaN patterns included): comparisons are byte-exact."""
    return random_fill(torch.empty(2, 2, 16, 32, dtype=torch.bfloat16), torch.Generator().manual_seed(seed))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def adapter(cluster: LocalRedisCluster, **kw: object) -> RedisClusterL2Adapter:
    prefix = f"t{uuid.uuid4().hex[:8]}:"  # the module's tests share one cluster
    return RedisClusterL2Adapter(
        cluster.url,
        key_prefix=prefix,
        socket_timeout_s=0.5,
        connect_timeout_s=0.5,
        **kw,  # type: ignore[arg-type]
    )


def keys_on(cluster: LocalRedisCluster, port: int, prefix: str) -> int:
    return sum(1 for _ in cluster.client(port).scan_iter(match=f"{prefix}*", count=1000))


def test_batches_spread_over_every_master_and_round_trip(shared_cluster: LocalRedisCluster) -> None:
    a = adapter(shared_cluster, ttl_s=600)
    keys = [(i + 1) << 64 | i for i in range(48)]
    chunks = {k: chunk(i) for i, k in enumerate(keys)}
    sizes: list[int] = []
    assert a.store_many([(k, chunks[k], sizes.append) for k in keys]) == sizes
    assert len(sizes) == 48 and all(s > chunks[keys[0]].numel() * 2 for s in sizes)
    per_master = [keys_on(shared_cluster, p, a.key_prefix) for p in shared_cluster.masters()]
    assert sum(per_master) == 48 and min(per_master) > 0, per_master  # every shard holds some
    outs = [torch.empty_like(chunks[k]) for k in keys]
    assert a.load_many(list(zip(keys, outs, strict=True))) == [True] * 48
    assert all(same(o, chunks[k]) for k, o in zip(keys, outs, strict=True))
    assert a.contains_many([*keys[:3], 7]) == [True, True, True, False]
    assert a.contains([]) == [] and a.load(7, outs[0]) is False
    name = chunk_name(a.key_prefix, keys[0])
    assert 0 < redis.Redis(port=shared_cluster.owner_of(key_slot(name))).ttl(name) <= 600
    assert a.delete(keys) == 48 and a.contains(keys[:2]) == [False, False]
    info = a.info()
    assert info["backend"] == "redis-cluster" and len(info["masters"]) == 3 and info["shards_down"] == {}
    a.close()


def test_corrupt_and_foreign_records_are_refused_and_deleted(shared_cluster: LocalRedisCluster) -> None:
    a = adapter(shared_cluster)
    t = chunk(1)
    a.store(5, t)
    name = chunk_name(a.key_prefix, 5)
    raw = redis.Redis(port=shared_cluster.owner_of(key_slot(name)))
    value = raw.get(name)
    assert value is not None
    raw.set(name, value[:-7])  # truncated, as by a crash or a maxmemory game
    with pytest.raises(CorruptChunkError):
        a.load(5, torch.empty_like(t))
    assert not raw.exists(name)
    other = torch.empty(2, 2, 8, 32, dtype=torch.bfloat16)  # another geometry under the same key
    payload = codec.tensor_bytes(other)
    raw.set(name, codec.encode_header(5, other, payload) + payload.tobytes())
    assert isinstance(a.load_many([(5, torch.empty_like(t))])[0], CorruptChunkError)
    assert not raw.exists(name)
    a.close()


def _migrate_slot(cluster: LocalRedisCluster, slot: int) -> tuple[int, int, str, str]:
    """Start moving ``slot`` to another master (IMPORTING/MIGRATING); returns ports and ids."""
    src = cluster.owner_of(slot)
    dst = next(p for p in cluster.masters() if p != src)
    src_id = cluster.client(src).execute_command("CLUSTER MYID").decode()
    dst_id = cluster.client(dst).execute_command("CLUSTER MYID").decode()
    cluster.client(dst).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    cluster.client(src).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    return src, dst, src_id, dst_id


def test_ask_and_moved_redirections_are_followed_by_the_client(shared_cluster: LocalRedisCluster) -> None:
    a = adapter(shared_cluster)
    t1, t2 = chunk(11), chunk(12)
    a.store(1, t1)  # the client learns the slot table now; the move below makes it stale
    slot = key_slot(chunk_name(a.key_prefix, 1))
    k2 = next(k for k in range(2, 1 << 20) if key_slot(chunk_name(a.key_prefix, k)) == slot)
    src, dst, _, dst_id = _migrate_slot(shared_cluster, slot)
    shared_cluster.client(src).execute_command(
        "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", chunk_name(a.key_prefix, 1)
    )
    out = torch.empty_like(t1)
    assert a.load(1, out) and same(out, t1)  # ASK: the key already moved, the slot not yet
    assert a.store(k2, t2) > 0  # ASK: a new key of a migrating slot is created on the target
    counts = [shared_cluster.client(p).execute_command("CLUSTER COUNTKEYSINSLOT", slot) for p in (src, dst)]
    assert counts == [0, 2]  # both keys live on the target already
    for port in shared_cluster.masters():
        shared_cluster.client(port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    wait_until(lambda: shared_cluster.owner_of(slot) == dst, 10, "the slot to move")
    assert a.load_many([(1, out), (k2, torch.empty_like(t2))]) == [True, True]  # MOVED
    assert same(out, t1) and a.contains([1, k2]) == [True, True]
    assert a.info()["shards_down"] == {}
    a.close()


def test_shard_health_fails_fast_and_logs_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    health = ShardHealth(2.0, lambda: now[0])
    err = StorageError("refused")
    with caplog.at_level(logging.INFO, "kvcache.storage.l2.redis.cluster"):
        assert health.blocked_for("a:1") == 0
        health.failed("a:1", err)
        health.failed("a:1", err)
        assert health.blocked_for("a:1") == 2.0 and health.blocked_for("b:1") == 0
        now[0] = 2.5
        assert health.blocked_for("a:1") == 0 and health.down() == {"a:1": 0.0}
        health.failed("a:1", err)  # tried again, still down: no second warning
        health.answered("a:1")
        health.failed("c:1", err)
        health.forget_unrouted({"a:1", "b:1"})  # c:1 no longer routed: replaced by its replica
    assert health.down() == {}
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is down" in m for m in lines) == 2 and sum("answer again" in m for m in lines) == 1
    assert sum("serves no slots" in m for m in lines) == 1


def _replicated(cluster: LocalRedisCluster) -> bool:
    sizes = [(cluster.client(m).dbsize(), [cluster.client(r).dbsize() for r in reps])
             for _, _, m, reps in cluster.slot_map()]  # fmt: skip
    return all(all(r == m for r in reps) for m, reps in sizes)


def test_unreachable_cluster_then_a_master_killed_mid_run() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not found on PATH (Debian: apt-get install redis-server)")
    cluster = LocalRedisCluster(masters=3, replicas=1, node_timeout_ms=1000)
    sink = RecordingSink()
    a = RedisClusterL2Adapter(cluster.url, socket_timeout_s=0.5, connect_timeout_s=0.5, shard_retry_s=0.3)
    tier = AsyncL2(a, workers=2, retry_interval_s=0.2, bus=sink)
    try:
        # Not started yet: the tier is unreachable as a whole (the adapter was built anyway).
        err = a.contains_many([1, 2])[0]
        assert isinstance(err, StorageError) and failure_scope(err) == "tier"
        assert failure_reason(err) == "unavailable"
        assert tier.contains([1]) == [False] and not tier.available
        cluster.start()
        keys = list(range(100, 160))
        chunks = {k: chunk(k) for k in keys}
        wait_until(lambda: tier.available and tier.contains([keys[0]]) == [False], 10, "the tier back")
        done: list[bool] = []
        for k in keys:
            assert tier.submit_store(k, chunks[k], done.append)
        assert tier.flush(10) and done == [True] * 60
        wait_until(lambda: _replicated(cluster), 10, "replicas in sync")

        victim = cluster.masters()[0]

        def owner(k: int, table: list[tuple[int, int, int, tuple[int, ...]]] | None = None) -> int:
            slot = key_slot(chunk_name("kvcache:", k))
            return next(m for lo, hi, m, _ in table or cluster.slot_map() if lo <= slot <= hi)

        table = cluster.slot_map()
        on_victim = sorted(k for k in keys if owner(k, table) == victim)
        assert 0 < len(on_victim) < len(keys)
        cluster.kill(victim)
        found = tier.contains(keys)
        assert [k for k, f in zip(keys, found, strict=True) if not f] == on_victim
        assert tier.available  # one shard down is not the tier down: the others still answer
        failed = [e for e in sink.of(EventType.L2_LOAD_FAILED) if e.metadata.reason == "unavailable"]
        assert failed and failed[-1].metadata.keys == on_victim
        again = a.contains_many(keys)  # fails fast now: no connection attempt
        assert all("is down (next try" in str(r) for r in again if isinstance(r, Exception))
        assert victim in {int(n.rsplit(":", 1)[1]) for n in a.info()["shards_down"]}

        new_master = cluster.wait_promoted(victim)
        wait_until(lambda: all(tier.contains(keys)), 10, "every slot answering after the promotion")
        outs = {k: torch.empty_like(chunks[k]) for k in on_victim}
        assert a.load_many([(k, outs[k]) for k in on_victim]) == [True] * len(on_victim)
        assert all(same(outs[k], chunks[k]) for k in on_victim)  # served by the promoted replica
        table = cluster.slot_map()
        moved = [k for k in range(1000, 5000) if owner(k, table) == new_master][:10]
        before = cluster.client(new_master).dbsize()
        for k in moved:  # chunks stored after the failover, in the slots that moved
            assert tier.submit_store(k, chunk(k), done.append)
        assert tier.flush(10) and done[60:] == [True] * 10
        assert cluster.client(new_master).dbsize() == before + 10
        assert tier.contains(moved) == [True] * 10 and a.info()["shards_down"] == {}
    finally:
        tier.close()
        cluster.close()


def test_a_live_master_refusing_during_a_failover_is_not_failed_fast(
    fresh_cluster: LocalRedisCluster,
) -> None:
    """While a dead master's slots wait for its replica, the live masters answer CLUSTERDOWN
    (``cluster-require-full-coverage yes``, Redis's default). That fails their keys for the
    moment, but must not put them into fail-fast: the whole tier would stay silent for the
    retry interval after the cluster is whole again."""
    cluster = fresh_cluster
    a = adapter(cluster, shard_retry_s=600)
    try:
        victim, live = cluster.masters()[:2]
        table = cluster.slot_map()

        def owner(k: int) -> int:
            slot = key_slot(chunk_name(a.key_prefix, k))
            return next(m for lo, hi, m, _ in table if lo <= slot <= hi)

        keys = [k for k in range(1, 200) if owner(k) == live][:8]
        chunks = {k: chunk(k) for k in keys}
        assert len(keys) == 8
        assert all(isinstance(r, int) for r in a.store_many([(k, chunks[k], None) for k in keys]))
        cluster.kill(victim)
        wait_until(lambda: cluster.client(live).cluster("info")["cluster_state"] == "fail", 10,
                   "the live master to see the dead one's slots unserved")  # fmt: skip
        refused = [r for r in a.load_many([(k, torch.empty_like(chunks[k])) for k in keys]) if r is not True]
        assert all("ClusterDownError" in str(r) and failure_scope(r) == "shard" for r in refused), refused
        cluster.wait_promoted(victim)
        outs = {k: torch.empty_like(chunks[k]) for k in keys}
        assert a.load_many([(k, outs[k]) for k in keys]) == [True] * len(keys)  # at once
        assert all(same(outs[k], chunks[k]) for k in keys)
        assert f"127.0.0.1:{live}" not in a.info()["shards_down"]
    finally:
        a.close()


def test_start_cluster_helper_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.skip.Exception, match="redis-server not found"):
        start_cluster()


def test_records_sealed_with_another_key_are_refused_on_every_shard(
    shared_cluster: LocalRedisCluster,
) -> None:
    """Another writer of the cluster (no key, or its own) overwrites some of a fleet's
    records, on every master: only the fleet's own sealed records are served (``seal``)."""
    victim = adapter(shared_cluster, seal=RecordSeal(b"v" * 32))
    attackers = [
        RedisClusterL2Adapter(shared_cluster.url, key_prefix=victim.key_prefix, seal=seal)
        for seal in (None, RecordSeal(b"a" * 32))
    ]
    keys = [(i + 1) << 64 | i for i in range(60)]  # every master owns some: (2/3)^60 otherwise
    victim.store_many([(k, chunk(i), None) for i, k in enumerate(keys)])
    # Two keys of each master forged, one by each attacker (the key prefix is the fleet's, so
    # which master owns a key differs from run to run: chosen by owner, not by index).
    by_owner: dict[object, list[int]] = {}
    for k in keys:
        by_owner.setdefault(shared_cluster.owner_of(key_slot(chunk_name(victim.key_prefix, k))), []).append(k)
    assert len(by_owner) == 3, by_owner
    forged = {k: attackers[j % 2] for owned in by_owner.values() for j, k in enumerate(owned[:2])}
    for k, attacker in forged.items():
        attacker.store(k, chunk(99))
    outs = [torch.empty_like(chunk(0)) for _ in keys]
    results = victim.load_many(list(zip(keys, outs, strict=True)))
    for i, (k, result) in enumerate(zip(keys, results, strict=True)):
        if k in forged:
            assert isinstance(result, ForgedRecordError), result
            assert not same(outs[i], chunk(99))
        else:
            assert result is True and same(outs[i], chunk(i))
    assert victim.contains_many(list(forged)) == [False] * len(forged)  # deleted, as corrupt ones are
    for a in (victim, *attackers):
        a.close()
