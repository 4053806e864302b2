"""Keys a real 3 + 3 Redis Cluster's masters drop by themselves (TTL) reach the bus as
L2_KEYS_EVICTED: every master followed (notifications are node-local), each key reported once
per daemon, and a replica promoted after its master's SIGKILL followed in its place."""

from __future__ import annotations

import uuid
from collections import Counter

import torch
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.observability.bus import EventBus
from kvcache.observability.event import Event, EventType, L2StoreFinished
from kvcache.observability.subscribers.metrics import L2MetricsSubscriber
from kvcache.storage.l2.redis.cluster import RedisClusterL2Adapter
from kvcache.storage.l2.redis.notify import covers
from kvcache.storage.l2.redis.single import chunk_name
from kvcache.testing.redis_cluster_local import LocalRedisCluster, wait_until
from tests.helpers import start_cluster
from tests.kv_events.test_subscriber import ListPublisher
from tests.storage.l2.redis.test_notify import WaitingSink


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(1024, generator=torch.Generator().manual_seed(seed))


def adapter(c: LocalRedisCluster, sink: object, prefix: str, **kw: object) -> RedisClusterL2Adapter:
    return RedisClusterL2Adapter(
        c.url, key_prefix=prefix, socket_timeout_s=0.5, connect_timeout_s=0.5, shard_retry_s=0.2,
        bus=sink, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def watching(a: RedisClusterL2Adapter, masters: list[int]) -> bool:
    """The adapter follows exactly these masters, each with notifications on."""
    w = a.info()["evictions_watched"]
    return set(w) == {f"127.0.0.1:{p}" for p in masters} and all(s in ("on", "enabled") for s in w.values())


def reported(sink: WaitingSink) -> Counter[int]:
    """How often each key was reported evicted."""
    return Counter(
        k for e in sink.events if e.event_type is EventType.L2_KEYS_EVICTED for k in e.metadata.keys
    )


def test_every_master_s_expiries_are_reported_once_per_daemon(shared_cluster: LocalRedisCluster) -> None:
    cluster = shared_cluster
    prefix = f"x{uuid.uuid4().hex[:8]}:"
    masters = cluster.masters()
    assert all(cluster.client(p).config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
               for p in masters)  # fmt: skip
    keys = list(range(1, 31))
    owners = {cluster.owner_of(key_slot(chunk_name(prefix, k))) for k in keys}
    assert owners == set(masters)  # the chunks spread over every master
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    pub = ListPublisher()
    sub = KVEventsSubscriber(pub, chunk_size=32, registry=reg)
    bus.register_subscriber(sub)
    bus.register_subscriber(L2MetricsSubscriber(reg))
    bus.start()
    sink_a, sink_b = WaitingSink(), WaitingSink()

    class Both:  # daemon A: its watcher feeds a KV-events router and the test
        def publish(self, event: Event) -> None:
            bus.publish(event)
            sink_a.publish(event)

    a = adapter(cluster, Both(), prefix, ttl_s=1)  # the writer: every chunk expires after 1 s
    b = adapter(cluster, sink_b, prefix)  # a second daemon on the same cluster, not writing
    try:
        for d in (a, b):
            wait_until(lambda d=d: watching(d, masters), 10, "every master followed")  # type: ignore[misc]
        assert all(covers(cluster.client(p).config_get("notify-keyspace-events")["notify-keyspace-events"])
                   for p in masters)  # fmt: skip
        for k in keys:
            meta = L2StoreFinished(backend="redis-cluster", keys=[k], num_bytes=0, duration_s=0.0)
            a.store(
                k, chunk(k), announce=lambda n, m=meta: bus.publish(Event(EventType.L2_STORE_FINISHED, m))
            )
        for sink in (sink_a, sink_b):
            assert sink.wait_for(lambda s=sink: set(reported(s)) >= set(keys), 15), reported(sink)  # type: ignore[misc]
            assert reported(sink) == Counter(keys)  # each once, nothing else under the prefix
        ev = next(e for e in sink_a.events if e.event_type is EventType.L2_KEYS_EVICTED)
        assert ev.metadata.backend == "redis-cluster" and ev.metadata.num_bytes == 0
        assert bus.flush(10)
        assert sub.held_keys("STORAGE") == set()  # a router saw every chunk withdrawn
        evicted = reg.get_sample_value("kvcache_l2_evicted_chunks_total", {"backend": "redis-cluster"})
        assert evicted == len(keys)
        removed = {h for e in pub.events() if e[0] == "BlockRemoved" and e[1] == "STORAGE" for h in e[2]}
        assert len(removed) == len(keys)
    finally:
        a.close()
        b.close()
        bus.stop()


def test_a_promoted_replica_is_followed_and_the_dead_master_dropped() -> None:
    c = start_cluster()
    sink = WaitingSink()
    a = adapter(c, sink, "p:", ttl_s=1)
    try:
        wait_until(lambda: watching(a, c.masters()), 10, "every master followed")
        victim = c.masters()[0]
        c.kill(victim)
        new = c.wait_promoted(victim)
        wait_until(lambda: watching(a, c.masters()), 10, "the new master followed, the dead one dropped")
        assert f"127.0.0.1:{victim}" not in a.info()["evictions_watched"]
        assert covers(c.client(new).config_get("notify-keyspace-events")["notify-keyspace-events"])
        keys = [k for k in range(1, 200) if c.owner_of(key_slot(chunk_name("p:", k))) == new][:8]
        for k in keys:
            a.store(k, chunk(k))
        assert sink.wait_for(lambda: set(reported(sink)) >= set(keys), 15), reported(sink)
        assert all(reported(sink)[k] == 1 for k in keys)
    finally:
        a.close()
        c.close()


def test_no_bus_no_watcher(shared_cluster: LocalRedisCluster) -> None:
    a = RedisClusterL2Adapter(shared_cluster.url)
    try:
        assert a.info()["evictions_watched"] == "off"
    finally:
        a.close()
