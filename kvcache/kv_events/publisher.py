"""Publishers of KV-event batches: the ABC, its null twin, the ZMQ publisher and a factory.

Separate from the bus subscriber that builds the batches (``subscriber.py``) so the socket
side can be tested, swapped or reused (a framework may publish its own batches) on its own.

Ordering promise of every publisher: batches go out in the order ``publish`` accepted them,
each with the next sequence number. ``publish`` never blocks and never raises; a batch that
finds the queue full is dropped and counted, and its sequence number is *consumed*, so a
subscriber sees the gap, finds that replay cannot fill it, and knows to resynchronise.
"""

from __future__ import annotations

import abc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvcache.kv_events.messages import END_SEQ, EventBatch, seq_bytes, seq_from_bytes

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_QUEUE_SIZE = 100_000
_IDLE_POLL_S = 0.005  # replay requests wait at most this long while no batch arrives


class EventPublisher(abc.ABC):
    """Sends ``EventBatch`` objects to routers; see the module docstring for the ordering promise."""

    @abc.abstractmethod
    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; never blocks, never raises (drops are counted)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then release sockets and threads; idempotent."""

    @property
    def published_batches(self) -> int:
        return 0

    @property
    def dropped_batches(self) -> int:
        return 0

    @property
    def queue_depth(self) -> int:
        return 0


class NullEventPublisher(EventPublisher):
    """What you get when KV events are off: ``publish`` is one empty call."""

    def publish(self, batch: EventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _should_bind(endpoint: str) -> bool:
    """vLLM's convention: wildcard, ipc and inproc addresses bind; a plain host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher(EventPublisher):
    """PUB socket (+ optional ROUTER replay socket) driven by its own thread.

    Frames: ``[topic, seq, payload]`` with ``seq`` 8 bytes big-endian from 0. Encoding and
    socket I/O run on the thread ``kvcache-kv-events``, fed by a bounded queue, so the caller
    (the event-bus dispatcher) only pays for a ``put_nowait``.

    Replay: a DEALER (or REQ) client sends the 8-byte start seq (a DEALER may put an empty
    delimiter frame first, as REQ does); it receives ``[seq, payload]`` for every buffered
    batch with ``seq >= start`` (the last ``buffer_steps`` sent) and then the end marker
    ``[END_SEQ, b""]``, each reply prefixed by the empty delimiter when the request had one.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        max_queue_size: int = DEFAULT_QUEUE_SIZE,
        data_parallel_rank: int = 0,
        linger_s: float = 1.0,
    ) -> None:
        if buffer_steps < 1 or max_queue_size < 1 or hwm < 0:
            raise ValueError("buffer_steps and max_queue_size must be >= 1, hwm >= 0")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._published = 0
        self._dropped = 0
        self._closed = False
        self._linger_ms = int(linger_s * 1000)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if _should_bind(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            raise ValueError(f"cannot open KV events socket: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="kvcache-kv-events", daemon=True)
        self._thread.start()

    # -- EventPublisher ------------------------------------------------------------------------

    def publish(self, batch: EventBatch) -> None:
        try:
            if self._closed:
                return
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self.data_parallel_rank
            with self._seq_lock:  # seq order == queue order, even with several publishers
                seq = next(self._seq)
                try:
                    self._queue.put_nowait((seq, batch))
                except queue.Full:
                    self._dropped += 1
        except Exception:  # the caller is the bus dispatcher: never raise
            logger.exception("KV events publish failed")

    def shutdown(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                break  # the thread sees _closed and stops after draining what it can
        self._thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def published_batches(self) -> int:
        return self._published

    @property
    def dropped_batches(self) -> int:
        return self._dropped

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def buffered_batches(self) -> int:
        return len(self._buffer)

    # -- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if self._replay is not None:
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=_IDLE_POLL_S if self._replay else 0.1)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if item is None:
                    break
                seq, batch = item
                try:
                    payload = encode(batch)
                    self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)
                    self._buffer.append((seq, payload))
                    self._published += 1
                except Exception:
                    self._dropped += 1
                    logger.exception("KV events: sending batch %d failed", seq)
        finally:
            self._close_sockets(self._linger_ms)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) == 2:
                ident, envelope, start = frames[0], [], frames[1]
            elif len(frames) == 3 and frames[1] == b"":
                ident, envelope, start = frames[0], [b""], frames[2]
            else:
                logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            if len(start) != 8:
                logger.warning("KV events: replay start must be 8 bytes, got %d", len(start))
                continue
            first = seq_from_bytes(start)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart([ident, *envelope, seq_bytes(seq), payload])
            self._replay.send_multipart([ident, *envelope, END_SEQ, b""])

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


PublisherCtor = Callable[..., EventPublisher]


class EventPublisherFactory:
    """Name -> publisher constructor. ``create(None)`` and ``create("null")`` give the null one."""

    def __init__(self) -> None:
        self._registry: dict[str, PublisherCtor] = {}

    def register(self, name: str, ctor: PublisherCtor) -> None:
        if name in self._registry:
            raise ValueError(f"KV event publisher {name!r} is already registered")
        self._registry[name] = ctor

    def names(self) -> list[str]:
        return sorted(self._registry)

    def create(self, kind: str | None, **kwargs: Any) -> EventPublisher:
        if kind is None:
            return NullEventPublisher()
        try:
            ctor = self._registry[kind]
        except KeyError:
            raise ValueError(
                f"unknown KV event publisher {kind!r} (known: {', '.join(self.names())})"
            ) from None
        return ctor(**kwargs)


def default_factory() -> EventPublisherFactory:
    """A factory knowing ``null`` and ``zmq``; callers may register more on their own copy."""
    factory = EventPublisherFactory()
    factory.register("null", NullEventPublisher)
    factory.register("zmq", ZmqEventPublisher)
    return factory


__all__ = [
    "DEFAULT_BUFFER_STEPS",
    "DEFAULT_HWM",
    "DEFAULT_QUEUE_SIZE",
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "default_factory",
]
