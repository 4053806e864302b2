"""Keys a real redis-server drops by itself (TTL, maxmemory) reach the bus as L2_KEYS_EVICTED.

Also: the watcher turns the server's keyspace notifications on when it may, and says so (log,
``info()``) when it may not; a KV-events router then sees BlockRemoved(STORAGE).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.observability.bus import EventBus
from kvcache.observability.event import Event, EventType, L2StoreFinished, NullEventBus
from kvcache.storage.l2.redis.notify import covers
from kvcache.storage.l2.redis.single import RedisL2Adapter
from kvcache.testing.redis_local import LocalRedis
from tests.kv_events.test_subscriber import ListPublisher

TTL_MS = 50
"""How far ahead a test expires a key: an EXPIRE whose time is already past when Redis checks
it (1 ms ahead, on a loaded machine) deletes the key with a ``del`` event, never ``expired``."""


class WaitingSink:
    """An EventSink a test can wait on (the watcher publishes from its own thread)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def publish(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def evicted(self) -> set[int]:
        with self._cond:
            return {
                k for e in self.events if e.event_type is EventType.L2_KEYS_EVICTED for k in e.metadata.keys
            }

    def wait_for(self, done: Callable[[], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(done, timeout)


def chunk(seed: int, kib: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kib * 256, generator=g)


def adapter(server: LocalRedis, sink: object, url: str | None = None, **kw: object) -> RedisL2Adapter:
    return RedisL2Adapter(url or server.url, socket_timeout_s=0.5, connect_timeout_s=0.5, bus=sink, **kw)  # type: ignore[arg-type]


def test_expired_keys_are_published_and_notifications_switched_on(redis_server: LocalRedis) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""  # server default
    sink = WaitingSink()
    a = adapter(redis_server, sink, key_prefix="t:")
    try:
        assert a.info()["evictions_watched"] == "enabled"
        assert set("Exe") <= set(raw.config_get("notify-keyspace-events")["notify-keyspace-events"])
        for key in (1 << 100, 2, 3):
            a.store(key, chunk(key % 7))
        raw.set("t:not-a-chunk", b"x", px=1)  # under the prefix but no chunk name: ignored
        raw.set("other:" + f"{5:032x}", b"x", px=1)  # another prefix: ignored
        raw.pexpire(f"t:{1 << 100:032x}", TTL_MS)
        raw.pexpire(f"t:{3:032x}", TTL_MS)
        assert sink.wait_for(lambda: sink.evicted() == {1 << 100, 3}), sink.events
        (ev, *_) = [e for e in sink.events if e.event_type is EventType.L2_KEYS_EVICTED]
        assert ev.metadata.backend == "redis" and ev.metadata.num_bytes == 0
    finally:
        a.close()


def test_maxmemory_evictions_reach_a_router_as_block_removed(redis_server: LocalRedis) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory", str(4 << 20))
    raw.config_set("maxmemory-policy", "allkeys-lru")
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    pub = ListPublisher()
    sub = KVEventsSubscriber(pub, chunk_size=32, registry=reg)
    bus.register_subscriber(sub)
    bus.start()
    sink = WaitingSink()

    class Both:
        def publish(self, event: Event) -> None:
            bus.publish(event)
            sink.publish(event)

    a = adapter(redis_server, Both())
    try:
        keys = list(range(1, 41))  # 40 x 256 KiB into a 4 MiB server
        for key in keys:
            meta = L2StoreFinished(backend="redis", keys=[key], num_bytes=0, duration_s=0.0)
            a.store(
                key,
                chunk(key, kib=256),
                announce=lambda n, m=meta: bus.publish(Event(EventType.L2_STORE_FINISHED, m)),
            )
        assert sink.wait_for(lambda: len(sink.evicted()) >= 20)
        assert bus.flush(10)
        gone = {k for k in keys if not raw.exists(f"kvcache:{k:032x}")}
        assert sink.wait_for(lambda: sink.evicted() == gone)
        assert bus.flush(10)
        assert sub.held_keys("STORAGE") == set(keys) - gone
        removed = [e for e in pub.events() if e[0] == "BlockRemoved"]
        assert all(e[1] == "STORAGE" for e in removed) and len({h for e in removed for h in e[2]}) == len(
            gone
        )
    finally:
        a.close()
        bus.stop()


def test_without_permission_to_switch_them_on_it_warns_and_says_so(
    redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    raw.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config")
    url = f"redis://app:pw@127.0.0.1:{redis_server.port}/0"
    sink = WaitingSink()
    with caplog.at_level(logging.WARNING, logger="kvcache.storage.l2.redis.notify"):
        a = adapter(redis_server, sink, url=url)
    try:
        assert a.info()["evictions_watched"] == "unknown"
        assert "notify-keyspace-events" in caplog.text and "Exe" in caplog.text
        # An operator who sets it by hand gets the events (the watcher subscribed anyway).
        raw.config_set("notify-keyspace-events", "Exe")
        a.store(7, chunk(7))
        raw.pexpire(f"kvcache:{7:032x}", TTL_MS)
        assert sink.wait_for(lambda: sink.evicted() == {7})
    finally:
        a.close()


def test_no_bus_no_watcher(redis_server: LocalRedis) -> None:
    """No bus, or the null bus (observability off): nobody would see the events, so no
    watcher thread and no server setting changed."""
    for bus in (None, NullEventBus()):
        a = RedisL2Adapter(redis_server.url, bus=bus)
        try:
            assert a.info()["evictions_watched"] == "off"
            raw = redis.Redis.from_url(redis_server.url)
            assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
        finally:
            a.close()


def test_a_restarted_server_is_followed_again(redis_server: LocalRedis) -> None:
    """The server forgets a CONFIG SET when it restarts: the watcher sets it again when it
    gets its feed back. Notifications are not queued, so the test expires a fresh chunk per
    attempt until one is reported (the watcher retries every second)."""
    sink = WaitingSink()
    a = adapter(redis_server, sink)
    try:
        redis_server.stop()
        redis_server.start()
        raw = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        key = 100
        while True:
            key += 1
            a.store(key, chunk(key))
            raw.pexpire(f"kvcache:{key:032x}", TTL_MS)
            if sink.wait_for(lambda key=key: key in sink.evicted(), timeout=0.5):  # type: ignore[misc]
                break
            assert time.monotonic() < deadline, "never followed again"
        assert covers(raw.config_get("notify-keyspace-events")["notify-keyspace-events"])
    finally:
        a.close()
