"""EventBus semantics: ordering, fan-out, filtering, bounds, drops, isolation, flush, stop."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import pytest
from prometheus_client import CollectorRegistry

from kvcache.observability.bus import Callback, EventBus, EventSubscriber, NullEventBus
from kvcache.observability.event import Event, EventMeta, EventType

A = EventType.MP_STORE_END
B = EventType.L1_READ_FINISHED


class Recorder(EventSubscriber):
    def __init__(self, types: Iterable[EventType] = (A, B), name: str | None = None) -> None:
        self.types = tuple(types)
        self.events: list[Event] = []
        self.shutdowns = 0
        self._name = name

    @property
    def name(self) -> str:
        return self._name or super().name

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return dict.fromkeys(self.types, self.events.append)

    def shutdown(self) -> None:
        self.shutdowns += 1


class Raiser(EventSubscriber):
    def subscriptions(self) -> Mapping[EventType, Callback]:
        def boom(event: Event) -> None:
            raise RuntimeError("subscriber bug")

        return {A: boom}


class Blocker(EventSubscriber):
    """Holds the dispatcher inside a callback until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def subscriptions(self) -> Mapping[EventType, Callback]:
        def hold(event: Event) -> None:
            self.entered.set()
            assert self.release.wait(10)

        return {A: hold}


class Seq(EventMeta, frozen=True, gc=False):
    """The bus never reads metadata: these tests tag events with a sequence number only."""

    seq: int = 0
    thread: int = 0


def ev(seq: int = 0, event_type: EventType = A, thread: int = 0) -> Event:
    return Event(event_type, Seq(seq=seq, thread=thread))


def test_ordering_per_publisher(bus: EventBus) -> None:
    rec = Recorder()
    bus.register_subscriber(rec)

    def publisher(tid: int) -> None:
        for i in range(2000):
            bus.publish(ev(i, thread=tid))

    threads = [threading.Thread(target=publisher, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bus.flush(10)
    for tid in range(4):
        seqs = [e.metadata.seq for e in rec.events if e.metadata.thread == tid]
        assert seqs == list(range(2000))


def test_fan_out_and_type_filtering(bus: EventBus) -> None:
    both, only_a, only_b = Recorder((A, B)), Recorder((A,)), Recorder((B,))
    for sub in (both, only_a, only_b):
        bus.register_subscriber(sub)
    bus.publish(ev(1, A))
    bus.publish(ev(2, B))
    bus.publish(ev(3, EventType.L2_CLEARED))  # nobody subscribed
    assert bus.flush(5)
    assert [e.metadata.seq for e in both.events] == [1, 2]
    assert [e.metadata.seq for e in only_a.events] == [1]
    assert [e.metadata.seq for e in only_b.events] == [2]
    assert bus.dispatched_events == 3


def test_timestamp_stamped_only_when_missing(bus: EventBus) -> None:
    rec = Recorder()
    bus.register_subscriber(rec)
    explicit = Event(A, Seq(), timestamp=123.5)
    implicit = Event(A, Seq())
    bus.publish(explicit)
    bus.publish(implicit)
    assert bus.flush(5)
    assert rec.events[0].timestamp == 123.5
    assert rec.events[1].timestamp is not None and rec.events[1].timestamp > 1e9


def test_bound_holds_under_concurrent_publishers(registry: CollectorRegistry) -> None:
    bus = EventBus(max_queue_size=1000, registry=registry)  # not started: nothing drains
    barrier = threading.Barrier(4)

    def publisher() -> None:
        barrier.wait()
        for i in range(1000):
            bus.publish(ev(i, A if i % 2 else B))

    threads = [threading.Thread(target=publisher) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bus.queue_depth == 1000
    assert bus.dropped_events == 3000
    dropped = {
        t: registry.get_sample_value("kvcache_event_bus_dropped_events_total", {"event_type": t.value})
        for t in (A, B, EventType.L2_CLEARED)
    }
    assert dropped[A] + dropped[B] == 3000  # type: ignore[operator]
    assert dropped[EventType.L2_CLEARED] == 0
    assert registry.get_sample_value("kvcache_event_bus_queue_depth") == 1000
    assert registry.get_sample_value("kvcache_event_bus_published_events_total") == 1000
    rec = Recorder()
    bus.register_subscriber(rec)
    assert bus.flush(5)  # not started: the caller's thread dispatches the backlog
    assert len(rec.events) == 1000
    bus.stop()


def test_full_queue_drops_the_new_event_not_the_old(registry: CollectorRegistry) -> None:
    bus = EventBus(max_queue_size=3, registry=registry)
    rec = Recorder()
    bus.register_subscriber(rec)
    for i in range(5):
        bus.publish(ev(i))
    bus.start()
    assert bus.flush(5)
    assert [e.metadata.seq for e in rec.events] == [0, 1, 2]
    assert bus.dropped_events == 2
    bus.stop()


def test_subscriber_exception_is_isolated_and_counted(bus: EventBus, registry: CollectorRegistry) -> None:
    rec = Recorder()
    bus.register_subscriber(Raiser())
    bus.register_subscriber(rec)
    for i in range(10):
        bus.publish(ev(i))
    assert bus.flush(5)
    assert len(rec.events) == 10
    assert bus.subscriber_errors("Raiser") == 10
    assert (
        registry.get_sample_value("kvcache_event_bus_subscriber_errors_total", {"subscriber": "Raiser"}) == 10
    )
    assert (
        registry.get_sample_value("kvcache_event_bus_subscriber_errors_total", {"subscriber": "Recorder"})
        == 0
    )


def test_publish_never_raises() -> None:
    bus = EventBus(max_queue_size=10, registry=None)
    bus.publish(None)  # type: ignore[arg-type]
    bus.publish(object())  # type: ignore[arg-type]
    bus.stop()
    bus.publish(ev())  # after stop: ignored


def test_flush_waits_for_dispatch_and_times_out(bus: EventBus) -> None:
    blocker, rec = Blocker(), Recorder()
    bus.register_subscriber(blocker)
    bus.register_subscriber(rec)
    bus.publish(ev(1))
    assert blocker.entered.wait(5)
    assert bus.flush(timeout=0.05) is False  # the dispatcher is stuck in a callback
    blocker.release.set()
    assert bus.flush(timeout=5) is True
    assert [e.metadata.seq for e in rec.events] == [1]


def test_stop_drains_then_shuts_down_once(registry: CollectorRegistry) -> None:
    bus = EventBus(max_queue_size=10_000, registry=registry)
    rec = Recorder()
    bus.register_subscriber(rec)
    bus.start()
    for i in range(5000):
        bus.publish(ev(i))
    bus.stop()
    assert len(rec.events) == 5000
    assert rec.shutdowns == 1
    bus.stop()
    assert rec.shutdowns == 1
    assert not bus.running
    bus.publish(ev(9))
    assert bus.flush(1)
    assert len(rec.events) == 5000


def test_stop_without_start_dispatches_backlog() -> None:
    bus = EventBus(registry=None)
    rec = Recorder()
    bus.register_subscriber(rec)
    bus.publish(ev(1))
    bus.stop()
    assert len(rec.events) == 1 and rec.shutdowns == 1


def test_subscriber_registered_after_start(bus: EventBus) -> None:
    bus.publish(ev(1))
    assert bus.flush(5)
    rec = Recorder()
    bus.register_subscriber(rec)
    bus.publish(ev(2))
    assert bus.flush(5)
    assert [e.metadata.seq for e in rec.events] == [2]


def test_self_metrics_exist_at_zero_and_count(registry: CollectorRegistry) -> None:
    bus = EventBus(max_queue_size=50, registry=registry)
    assert registry.get_sample_value("kvcache_event_bus_queue_depth") == 0
    assert registry.get_sample_value("kvcache_event_bus_queue_capacity") == 50
    assert registry.get_sample_value("kvcache_event_bus_dispatched_events_total") == 0
    assert registry.get_sample_value("kvcache_event_bus_dispatch_lag_seconds_count") == 0
    bus.start()
    for i in range(20):
        bus.publish(ev(i))
    assert bus.flush(5)
    assert registry.get_sample_value("kvcache_event_bus_dispatched_events_total") == 20
    assert registry.get_sample_value("kvcache_event_bus_published_events_total") == 20
    assert registry.get_sample_value("kvcache_event_bus_dispatch_lag_seconds_count") >= 1  # type: ignore[operator]
    bus.stop()


def test_disabled_bus_is_a_null_object() -> None:
    bus = NullEventBus()
    rec = Recorder()
    bus.register_subscriber(rec)
    bus.start()
    bus.publish(ev(1))
    assert bus.flush(0.1) is True
    bus.stop()
    assert rec.events == [] and rec.shutdowns == 0
    assert bus.enabled is False and bus.dropped_events == 0


def test_invalid_queue_size() -> None:
    with pytest.raises(ValueError):
        EventBus(max_queue_size=0, registry=None)
