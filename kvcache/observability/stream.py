"""Publish an event when a CUDA stream reaches the point where it was enqueued.

Separate from the bus because it is the only observability code that touches the native
module. The CUDA host function that marks "the stream got here" is native
(``kvcache._native.HostEventQueue``): it stamps ``(token, CLOCK_MONOTONIC ns)`` into a
native buffer and never takes the GIL. A Python host callback would need the GIL while the
thread that holds it may be waiting on the stream, which is how LMCache deadlocked. Python
only drains that buffer, from the bus dispatcher (while tokens are pending) and in
``EventBus.flush``.

Timestamps come from one ``AnchoredClock`` per bus: ``wall0 + (mono - mono0)``, anchored
once. Both the immediate (CPU) path and the drained (CUDA) path use it, so an end event
never precedes its start even if the wall clock steps.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvcache.observability.event import Event, EventSink

if TYPE_CHECKING:
    from kvcache.observability.bus import EventBus

logger = logging.getLogger(__name__)


class AnchoredClock:
    """Wall-clock seconds derived from the monotonic clock, anchored once at construction."""

    def __init__(self, wall0: float | None = None, mono0_ns: int | None = None) -> None:
        self.mono0_ns = time.monotonic_ns() if mono0_ns is None else mono0_ns
        self.wall0 = time.time() if wall0 is None else wall0

    def from_monotonic_ns(self, mono_ns: int) -> float:
        """Seconds since the epoch for a CLOCK_MONOTONIC reading (native or ``time``)."""
        return self.wall0 + (mono_ns - self.mono0_ns) / 1e9

    def now(self) -> float:
        return self.from_monotonic_ns(time.monotonic_ns())


class _HostQueue(Protocol):
    def record(self, stream: int, token: int) -> None: ...
    def drain(self) -> list[tuple[int, int]]: ...


def _load_host_queue() -> _HostQueue | None:
    """The native queue, or None when the extension is absent (pure-CPU installs)."""
    try:
        native = importlib.import_module("kvcache._native")
    except ImportError:
        return None
    queue: _HostQueue = native.HostEventQueue()
    return queue


def stream_handle(stream: Any) -> int | None:
    """``cudaStream_t`` as an int: accepts None, an int, or a ``torch.cuda.Stream``."""
    if stream is None or isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    return int(handle) if handle is not None else None


class StreamEventRecorder:
    """Per-bus state behind ``publish_on_stream``: pending tokens and the anchored clock.

    Thread-safe: any thread may ``publish``; ``drain`` is serialised by a lock.
    """

    def __init__(
        self,
        bus: EventBus,
        host_queue: _HostQueue | None = None,
        clock: AnchoredClock | None = None,
    ) -> None:
        self._bus = bus
        self._host_queue = host_queue if host_queue is not None else _load_host_queue()
        self.clock = clock if clock is not None else AnchoredClock()
        self._pending: dict[int, Event] = {}
        self._tokens = itertools.count(1)
        self._drain_lock = threading.Lock()
        self._cuda_ok = self._host_queue is not None
        bus.add_poller(self.drain)

    @property
    def pending(self) -> int:
        """Events recorded on a stream whose host function has not been drained yet."""
        return len(self._pending)

    def publish(self, stream: Any, event: Event) -> None:
        handle = stream_handle(stream)
        if handle is None or not self._cuda_ok:
            self._publish_now(event)
            return
        token = next(self._tokens)
        self._pending[token] = event
        try:
            assert self._host_queue is not None
            self._host_queue.record(handle, token)
        except RuntimeError:  # no CUDA (kvcache._native.CudaUnavailable is a RuntimeError)
            del self._pending[token]
            if handle != 0:
                logger.warning("CUDA stream %#x given but CUDA is unavailable", handle)
            self._cuda_ok = False
            self._publish_now(event)
        else:
            self._bus.wake()  # the dispatcher must start polling for the new token

    def _publish_now(self, event: Event) -> None:
        if event.timestamp is None:
            event.timestamp = self.clock.now()
        self._bus.publish(event)

    def drain(self) -> bool:
        """Publish every event whose stream point was reached; True while some still wait."""
        if not self._pending:
            return False
        assert self._host_queue is not None
        with self._drain_lock:
            for token, mono_ns in self._host_queue.drain():
                event = self._pending.pop(token, None)
                if event is None:
                    continue
                if event.timestamp is None:
                    event.timestamp = self.clock.from_monotonic_ns(mono_ns)
                self._bus.publish(event)
        return bool(self._pending)


def publish_on_stream(bus: EventSink, stream: Any, event: Event) -> None:
    """Publish ``event`` once ``stream`` has executed everything enqueued before this call.

    ``stream`` is None (CPU work: published at once), an int ``cudaStream_t`` or a
    ``torch.cuda.Stream``. Without CUDA (or without the native module) the event is
    published at once. ``bus`` may be any ``EventSink``: sinks other than a running
    ``EventBus`` (``NullEventSink``, ``DisabledEventBus``) just get ``publish``. Like
    ``EventBus.publish`` this never raises.
    """
    try:
        recorder = getattr(bus, "stream_recorder", None) if getattr(bus, "enabled", True) else None
        if recorder is None:
            bus.publish(event)
        else:
            recorder.publish(stream, event)
    except Exception:  # never raise into the data path
        logger.debug("publish_on_stream failed", exc_info=True)


__all__ = ["AnchoredClock", "StreamEventRecorder", "publish_on_stream", "stream_handle"]
