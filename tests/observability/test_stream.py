"""publish_on_stream: CPU path, anchored timestamps, drain-on-flush, and the real CUDA path."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest

from kvcache.observability.bus import Callback, DisabledEventBus, EventBus, EventSubscriber
from kvcache.observability.event import Event, EventMeta, EventType, NullEventSink
from kvcache.observability.stream import (
    AnchoredClock,
    StreamEventRecorder,
    publish_on_stream,
    stream_handle,
)

START, END = EventType.MP_STORE_START, EventType.MP_STORE_END


class N(EventMeta, frozen=True, gc=False):
    """The stream path never reads metadata: a number to tell events apart."""

    n: int = 0


class Recorder(EventSubscriber):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {START: self.events.append, END: self.events.append}


class ScriptedHostQueue:
    """Stands in for the native queue's contract on machines without CUDA: ``complete``
    plays the stream reaching a recorded point at a given monotonic time."""

    def __init__(self) -> None:
        self.recorded: list[tuple[int, int]] = []
        self._done: list[tuple[int, int]] = []

    def record(self, stream: int, token: int) -> None:
        self.recorded.append((stream, token))

    def complete(self, token: int, mono_ns: int) -> None:
        self._done.append((token, mono_ns))

    def drain(self) -> list[tuple[int, int]]:
        done, self._done = self._done, []
        return done


def test_anchored_clock_maps_monotonic_to_wall() -> None:
    clock = AnchoredClock(wall0=1000.0, mono0_ns=5_000_000_000)
    assert clock.from_monotonic_ns(5_000_000_000) == 1000.0
    assert clock.from_monotonic_ns(6_500_000_000) == 1001.5
    real = AnchoredClock()
    a = real.now()
    b = real.now()
    assert b >= a and abs(a - time.time()) < 1.0


def test_cpu_stream_publishes_at_once_with_anchored_time(bus: EventBus) -> None:
    rec = Recorder()
    bus.register_subscriber(rec)
    publish_on_stream(bus, None, Event(START, N(n=1)))
    publish_on_stream(bus, None, Event(END, N(n=1)))
    explicit = Event(END, N(n=2), timestamp=42.0)
    publish_on_stream(bus, None, explicit)
    assert bus.flush(5)
    start, end, kept = rec.events
    assert start.timestamp is not None and end.timestamp is not None
    assert start.timestamp <= end.timestamp
    assert abs(start.timestamp - time.time()) < 5
    assert kept.timestamp == 42.0


def test_stream_zero_without_cuda_publishes_at_once(bus: EventBus) -> None:
    native = pytest.importorskip("kvcache._native")
    if native.cuda_device_count() > 0:
        pytest.skip("CUDA present: stream 0 really is a CUDA stream here")
    rec = Recorder()
    bus.register_subscriber(rec)
    publish_on_stream(bus, 0, Event(START, N()))
    assert bus.flush(5)
    assert len(rec.events) == 1
    assert bus.stream_recorder.pending == 0


def test_recorded_events_wait_for_the_stream_and_are_stamped_from_it(bus: EventBus) -> None:
    host = ScriptedHostQueue()
    clock = AnchoredClock(wall0=2000.0, mono0_ns=10**12)
    recorder = StreamEventRecorder(bus, host_queue=host, clock=clock)
    rec = Recorder()
    bus.register_subscriber(rec)
    recorder.publish(7, Event(START, N(), session_id="s"))
    recorder.publish(7, Event(END, N(), session_id="s"))
    assert [s for s, _ in host.recorded] == [7, 7]
    assert bus.flush(5)
    assert rec.events == [] and recorder.pending == 2  # the stream has not got there yet
    (_, t1), (_, t2) = host.recorded
    host.complete(t1, 10**12 + 1_000_000)  # 1 ms after the anchor
    host.complete(t2, 10**12 + 3_000_000)
    assert bus.flush(5)  # flush drains the host queue before waiting
    assert [e.event_type for e in rec.events] == [START, END]
    assert rec.events[0].timestamp == pytest.approx(2000.001)
    assert rec.events[1].timestamp == pytest.approx(2000.003)
    assert recorder.pending == 0


def test_dispatcher_drains_without_flush(bus: EventBus) -> None:
    host = ScriptedHostQueue()
    recorder = StreamEventRecorder(bus, host_queue=host)
    rec = Recorder()
    bus.register_subscriber(rec)
    recorder.publish(3, Event(START, N()))
    host.complete(host.recorded[0][1], time.monotonic_ns())
    deadline = time.monotonic() + 5
    while not rec.events and time.monotonic() < deadline:
        time.sleep(0.001)  # polling for the dispatcher's own drain, not pacing the test
    assert len(rec.events) == 1


def test_stream_handle_accepts_torch_like_streams() -> None:
    class FakeStream:
        cuda_stream = 0xABC

    assert stream_handle(None) is None
    assert stream_handle(5) == 5
    assert stream_handle(FakeStream()) == 0xABC


def test_disabled_bus_and_null_sink_ignore_stream_events() -> None:
    publish_on_stream(DisabledEventBus(), None, Event(START, N()))
    publish_on_stream(NullEventSink(), 0, Event(START, N()))


@pytest.mark.cuda
def test_real_cuda_stream_orders_end_after_start(bus: EventBus) -> None:
    import torch

    rec = Recorder()
    bus.register_subscriber(rec)
    stream = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda")
    publish_on_stream(bus, None, Event(START, N()))
    with torch.cuda.stream(stream):
        for _ in range(4):
            x = x @ x
            x = x / x.norm()
    publish_on_stream(bus, stream, Event(END, N()))
    stream.synchronize()
    assert bus.flush(10)
    assert [e.event_type for e in rec.events] == [START, END]
    start, end = rec.events
    assert start.timestamp is not None and end.timestamp is not None
    assert end.timestamp >= start.timestamp
    assert bus.stream_recorder.pending == 0
