"""The in-process event bus: a bounded queue, one dispatcher thread, per-type fan-out.

The data path only calls ``publish``; everything that turns events into metrics, logs or
traces is an ``EventSubscriber`` registered here. Keeping the bus apart from the
subscribers is what makes observability removable (deleting ``subscribers/`` leaves the
engine working) and lets a slow or broken subscriber cost the data path nothing.

Contract:

* ``publish(event)`` never blocks on a full queue and never raises. It stamps
  ``time.time()`` only when ``event.timestamp`` is None. When the queue holds
  ``max_queue_size`` events the *new* event is dropped and counted; the bound holds under
  any number of concurrent publishers.
* One dispatcher thread calls subscribers, in publish order per publishing thread (events
  from different threads interleave in the order they entered the queue).
* A subscriber callback that raises is counted per subscriber and logged (rate limited);
  the remaining subscribers still receive the event.
* ``flush(timeout)`` returns True once everything published before the call has been
  dispatched (tests use it instead of sleeping). ``stop()`` stops accepting events,
  drains the queue, then calls every subscriber's ``shutdown``; it is idempotent.
* ``NullEventBus`` (``event.py``) is the null twin: ``publish`` is one empty call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus_metrics import BusMetrics, BusSnapshot
from kvcache.observability.event import Event, EventType, NullEventBus  # the null twin, re-exported
from kvcache.observability.instruments import MetricSet
from kvcache.observability.subscriber import Callback, EventSubscriber  # re-exported

logger = logging.getLogger(__name__)

_BATCH_LIMIT = 4096  # events per hold of the dispatch lock under sustained load
_LAG_SAMPLE_EVERY = 256  # besides the first event of every batch
_WARN_INTERVAL_S = 10.0


class EventBus:
    """Bounded, drop-on-full event queue with one dispatcher thread (see module docstring)."""

    enabled = True

    def __init__(
        self,
        max_queue_size: int = 10_000,
        *,
        registry: CollectorRegistry | None,
    ) -> None:
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        self.max_queue_size = max_queue_size
        # (event, monotonic enqueue time); a flush marker is (None, threading.Event).
        self._queue: deque[tuple[Event | None, float | threading.Event]] = deque()
        self._publish_lock = threading.Lock()  # makes "check length + append" atomic
        self._dispatch_lock = threading.Lock()  # one dispatching thread at a time
        self._state_lock = threading.Lock()
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._idle = False
        self._closed = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Keyed by the EventType's value: a str hash is cached, an Enum member's is a Python call.
        self._routes: dict[str, tuple[tuple[str, Callback], ...]] = {}
        self._subscribers: list[EventSubscriber] = []
        # Self-metrics: plain ints, read by the collector at scrape time.
        self._accepted = 0
        self._dispatched = 0
        self._dropped: dict[str, int] = {t.value: 0 for t in EventType}  # by value: cheap hash
        self._errors: dict[str, int] = {}
        self._error_logged_at: dict[str, float] = {}
        self._drops_warned = 0
        self._drop_warned_at = 0.0
        self._self_metrics = BusMetrics(max_queue_size, self._snapshot)
        self._lag = self._self_metrics.lag
        if registry is not None:
            self._self_metrics.metrics.register(registry)

    # -- hot path ------------------------------------------------------------------------

    def publish(self, event: Event) -> None:
        """Enqueue ``event`` for dispatch; drops (and counts) it if the queue is full."""
        try:
            if self._closed:
                return
            if event.timestamp is None:
                event.timestamp = time.time()
            with self._publish_lock:
                if len(self._queue) >= self.max_queue_size:
                    self._dropped[event.event_type._value_] += 1
                    return
                self._queue.append((event, time.monotonic()))
                self._accepted += 1
            if self._idle:
                self._idle = False
                self._wakeup.put(None)
        except Exception:  # the hot path must never raise
            pass

    # -- lifecycle -----------------------------------------------------------------------

    def register_subscriber(self, subscriber: EventSubscriber) -> None:
        """Route the subscriber's event types to it; allowed before or after ``start``."""
        name = subscriber.name
        with self._state_lock:
            routes = dict(self._routes)
            for event_type, callback in subscriber.subscriptions().items():
                key = event_type.value
                routes[key] = (*routes.get(key, ()), (name, callback))
            self._errors.setdefault(name, 0)
            self._subscribers.append(subscriber)
            self._routes = routes  # swapped whole: the dispatcher reads one consistent table

    @property
    def subscribers(self) -> tuple[EventSubscriber, ...]:
        return tuple(self._subscribers)

    def start(self) -> None:
        """Start the dispatcher thread; a second call is a no-op."""
        with self._state_lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._run, name="kvcache-event-bus", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopped

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event published before this call was dispatched.

        Returns False if ``timeout`` seconds passed first. Without a running dispatcher
        (not started, or stopped) the caller's thread dispatches the backlog itself.
        """
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self._drain_inline(timeout)
        done = threading.Event()
        with self._publish_lock:
            self._queue.append((None, done))
        self._wake()
        if done.wait(timeout):
            return True
        if not thread.is_alive():  # stopped meanwhile: the marker may be stranded
            return self._drain_inline(timeout)
        return False

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop accepting events, dispatch the backlog, then shut every subscriber down."""
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._wake()
            thread.join(timeout)
        self._drain_inline(timeout)
        for subscriber in self._subscribers:
            try:
                subscriber.shutdown()
            except Exception:
                self._errors[subscriber.name] = self._errors.get(subscriber.name, 0) + 1
                logger.exception("subscriber %s failed to shut down", subscriber.name)

    def __enter__(self) -> EventBus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- read-backs (also exposed as metrics) ----------------------------------------------

    @property
    def metrics(self) -> MetricSet:
        """The bus's self-metrics (registered with the registry given at construction)."""
        return self._self_metrics.metrics

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def dropped_events(self) -> int:
        return sum(self._dropped.values())

    @property
    def dispatched_events(self) -> int:
        return self._dispatched

    def subscriber_errors(self, name: str) -> int:
        return self._errors.get(name, 0)

    # -- dispatcher ----------------------------------------------------------------------

    def _wake(self) -> None:
        self._idle = False
        self._wakeup.put(None)

    def _run(self) -> None:
        q = self._queue
        while True:
            if q:
                with self._dispatch_lock:
                    self._dispatch_batch(_BATCH_LIMIT)
                continue
            self._idle = True
            if q:  # published between the check above and going idle
                self._idle = False
                continue
            if self._closed:
                return
            self._wakeup.get()
            self._idle = False

    def _drain_inline(self, timeout: float | None) -> bool:
        if not self._dispatch_lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._dispatch_batch()
        finally:
            self._dispatch_lock.release()
        return True

    def _dispatch_batch(self, limit: int = -1) -> None:
        """Dispatch until the queue is empty or ``limit`` events went; holds ``_dispatch_lock``."""
        q = self._queue
        popleft = q.popleft
        errors = self._errors
        lag = self._lag
        first = True
        n = 0
        while q and n != limit:
            event, stamp = popleft()
            if event is None:
                assert isinstance(stamp, threading.Event)
                stamp.set()
                continue
            n += 1
            if first or n % _LAG_SAMPLE_EVERY == 0:
                assert isinstance(stamp, float)
                lag.observe(time.monotonic() - stamp)
                first = False
            for name, callback in self._routes.get(event.event_type._value_, ()):
                try:
                    callback(event)
                except Exception:
                    errors[name] = errors.get(name, 0) + 1
                    self._log_subscriber_error(name, event)
        self._dispatched += n
        if self._drops_warned != self.dropped_events:
            self._warn_drops()

    def _log_subscriber_error(self, name: str, event: Event) -> None:
        now = time.monotonic()
        if now - self._error_logged_at.get(name, -_WARN_INTERVAL_S) >= _WARN_INTERVAL_S:
            self._error_logged_at[name] = now
            logger.exception(
                "subscriber %s raised on %s (%d errors so far; next log in %.0fs at most)",
                name,
                event.event_type.value,
                self._errors[name],
                _WARN_INTERVAL_S,
            )

    def _warn_drops(self) -> None:
        now = time.monotonic()
        if now - self._drop_warned_at >= _WARN_INTERVAL_S:
            dropped = self.dropped_events
            logger.warning(
                "event bus queue full (%d): %d events dropped so far",
                self.max_queue_size,
                dropped,
            )
            self._drops_warned = dropped
            self._drop_warned_at = now

    def _snapshot(self) -> BusSnapshot:
        return BusSnapshot(
            len(self._queue),
            self._accepted,
            self._dispatched,
            dict(self._dropped),
            dict(self._errors),
        )


__all__ = ["Callback", "EventBus", "EventSubscriber", "NullEventBus"]
