"""``ZmqEventPublisher``: KV-event batches to routers over a ZMQ PUB socket, with replay.

Its own module because it is the one publisher with sockets, a thread, a replay buffer and
reader checks; the contract it keeps (ordering, never blocking) is ``publisher``'s.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvcache.kv_events.messages import EventBatch, seq_bytes
from kvcache.kv_events.publisher import EventPublisher
from kvcache.kv_events.replay import DEFAULT_REPLAY_RATE, ReplayBudget, ReplayServer
from kvcache.netaddr import unix_socket_live

if TYPE_CHECKING:
    from kvcache.server.auth import AccessPolicy

logger = logging.getLogger("kvcache.kv_events.publisher")  # the name it logged under before the split

DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_QUEUE_SIZE = 100_000
DEFAULT_BATCH_WINDOW_S = 0.010
"""Least time between two wire batches: what arrives meanwhile is merged into the next one.
10 ms is within a serving engine's scheduler step, the granularity vLLM publishes at."""
DEFAULT_MAX_MERGE = 1024  # accepted batches per wire batch at most (bounds message size)
_IDLE_POLL_S = 0.005  # replay requests wait at most this long while no batch arrives
_REPLAY_FRAME_MAX = 4096  # bytes in a frame of a replay request (8 used; ZMTP commands too)
_COPY_BELOW = 65_536  # ZMQ: copying a small frame is cheaper than tracking a zero-copy one


def should_bind(endpoint: str) -> bool:
    """vLLM's convention: wildcard, ipc and inproc addresses bind; a plain host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def wants_ipv6(endpoint: str) -> bool:
    """A bracketed IPv6 host (``tcp://[::1]:5557``): ZMQ opens it only with ``ZMQ_IPV6`` set."""
    return "://[" in endpoint


def _merge(batches: list[EventBatch]) -> EventBatch:
    """One wire batch holding ``batches``' events in order; stamped with the latest ``ts``."""
    if len(batches) == 1:
        return batches[0]
    events: list[Any] = []
    for b in batches:
        events += b.events
    last = batches[-1]
    return EventBatch(ts=last.ts, events=events, data_parallel_rank=last.data_parallel_rank)


class ZmqEventPublisher(EventPublisher):
    """PUB socket (+ optional ROUTER replay socket) driven by its own thread.

    Frames: ``[topic, seq, payload]`` with ``seq`` 8 bytes big-endian from 0. Encoding and
    socket I/O run on the thread ``kvcache-kv-events``; the caller (the event-bus
    dispatcher) only appends to a bounded deque, and wakes the thread only when it sleeps.

    Coalescing: the thread sends at most one wire batch per ``batch_window_s`` unless
    ``max_merge`` batches are already waiting; the batches accepted meanwhile (up to
    ``max_merge``, all with the same ``data_parallel_rank``) go out merged, in order, as
    one. The first batch after a quiet spell goes at once. ``batch_window_s=0`` sends as
    soon as the thread runs (still merging what queued up while it was busy);
    ``max_merge=1`` gives one wire batch per accepted batch.

    Replay: a DEALER (or REQ) client sends the 8-byte start seq (a DEALER may put an empty
    delimiter frame first, as REQ does); it receives ``[topic, seq, payload]`` for every
    buffered wire batch with ``seq >= start`` (the last ``buffer_steps`` sent) and then the
    end marker ``[b"", END_SEQ, b""]`` (vLLM's replay shape), each reply prefixed by the
    empty delimiter when the request had one. Replays draw on a budget of ``replay_rate``
    batches a second, all readers together (``replay``: what a flood of requests costs).

    Readers: with ``readers`` given, every socket this publisher binds asks ZAP (answered
    by that ``AccessPolicy`` on this publisher's own ZMQ context) about each connection:
    ipc:// peers by uid, TCP peers by CURVE key, for which ``curve_keys`` (the daemon's
    public and secret key) make the bound TCP sockets CURVE servers. A PUB that connects
    (to a router that binds) is the router's to vet.
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
        batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
        max_merge: int = DEFAULT_MAX_MERGE,
        readers: AccessPolicy | None = None,
        curve_keys: tuple[bytes, bytes] | None = None,
        replay_rate: float = DEFAULT_REPLAY_RATE,
    ) -> None:
        if buffer_steps < 1 or max_queue_size < 1 or hwm < 0 or max_merge < 1 or batch_window_s < 0:
            raise ValueError(
                "buffer_steps, max_queue_size and max_merge must be >= 1, hwm and batch_window_s >= 0"
            )
        budget = ReplayBudget(replay_rate, buffer_steps)  # raises ValueError for a bad rate
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.batch_window_s = batch_window_s
        self.max_merge = max_merge
        self._topic = topic.encode("utf-8")
        self._max_queue = max_queue_size
        self._pending: deque[EventBatch] = deque()
        self._lock = threading.Lock()  # "check length + append" and the drop count are atomic
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._idle = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._accepted = 0
        self._refused = 0  # dropped by publish (queue full); under _lock
        self._done = 0  # accepted batches the thread sent or failed to send; under _done_cond
        self._failed = 0
        self._done_cond = threading.Condition()
        self._published = 0
        self._flush_upto = 0  # a flush waits for the batches accepted up to here: no window
        self._skip = False  # a batch was dropped since the last send: consume a seq for it
        self._closed = False
        self._linger_ms = int(linger_s * 1000)
        self._ctx = zmq.Context()
        self._zap: Any = None
        self._readers = readers
        self._curve_keys = curve_keys
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay: zmq.Socket[Any] | None = None
        self._replayer: ReplayServer | None = None
        try:
            if readers is not None:
                from kvcache.server.auth import ZapHandler

                self._zap = ZapHandler(self._ctx, readers)
            if wants_ipv6(endpoint):
                self._pub.setsockopt(zmq.IPV6, 1)
            if should_bind(endpoint):
                self._guard(self._pub, endpoint)
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, _REPLAY_FRAME_MAX)  # a reader's bytes
                # One whole replay queues for a reader that lags, never cut (ZMQ's 1,000
                # dropped a longer one's tail, end marker included); its frames refer to
                # the buffered batches (``_serve_replay``), so that costs no copy of them.
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                if wants_ipv6(replay_endpoint):
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._guard(self._replay, replay_endpoint)
                self._replay.bind(replay_endpoint)
                self._replayer = ReplayServer(self._replay, self._topic, self._buffer, budget)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            raise ValueError(f"cannot open KV events socket: {exc}") from exc
        except BaseException:  # refused by _guard: nothing may stay open
            self._close_sockets(0)
            raise
        self._thread = threading.Thread(target=self._run, name="kvcache-kv-events", daemon=True)
        self._thread.start()

    def _guard(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        """Before ``sock`` binds ``endpoint``: refuse an ipc:// path another process listens
        on (ZMQ's bind would unlink it from under that process, say a second daemon started
        on the same runtime directory), then have ZAP vet the readers, with CURVE on TCP."""
        if endpoint.startswith("ipc://") and unix_socket_live(endpoint.removeprefix("ipc://")):
            raise ValueError(f"another process listens on {endpoint}; pick another address")
        if self._readers is None:
            return
        from kvcache.server.auth import ZAP_DOMAIN

        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        if not endpoint.startswith(("tcp://", "ws://", "wss://")):
            return  # ipc: ZAP checks the peer's uid; anything else fails to bind anyway
        if self._curve_keys is None:
            raise ValueError(f"KV events on {endpoint} need CURVE keys to authenticate readers")
        public, secret = self._curve_keys
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    # -- EventPublisher ------------------------------------------------------------------------

    def publish(self, batch: EventBatch) -> None:
        try:
            if self._closed:
                return
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self.data_parallel_rank
            with self._lock:
                self._accepted += 1
                if len(self._pending) >= self._max_queue:
                    self._refused += 1
                    self._skip = True
                    return
                self._pending.append(batch)
            if self._idle:
                self._idle = False
                self._wakeup.put(None)
        except Exception:  # the caller is the bus dispatcher: never raise
            logger.exception("KV events publish failed")

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            target = self._accepted
            self._flush_upto = max(self._flush_upto, target)  # "now", not after the window
        self._wakeup.put(None)
        with self._done_cond:
            return self._done_cond.wait_for(lambda: self._done + self._refused >= target, timeout)

    def shutdown(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup.put(None)
        self._thread.join(timeout)

    @property
    def published_batches(self) -> int:
        return self._published

    @property
    def dropped_batches(self) -> int:
        return self._refused + self._failed

    @property
    def replay_requests_served(self) -> int:
        """Replay requests taken (malformed ones too)."""
        return self._replayer.requests if self._replayer is not None else 0

    @property
    def replay_requests(self) -> int:
        return self.replay_requests_served

    @property
    def replayed_batches(self) -> int:
        return self._replayer.batches if self._replayer is not None else 0

    @property
    def replays_cut(self) -> int:
        """Replies stopped early because their reader did not read them (or left)."""
        return self._replayer.cut if self._replayer is not None else 0

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def buffered_batches(self) -> int:
        return len(self._buffer)

    # -- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        pending = self._pending
        window = self.batch_window_s
        idle_wait = _IDLE_POLL_S if self._replayer is not None else None
        last_send = 0.0
        try:
            while True:
                more = self._replayer is not None and self._replayer.serve() == 0.0
                if not pending:
                    if self._closed:
                        break
                    if more:  # requests wait and no batch does: serve on
                        continue
                    self._idle = True
                    if pending or self._closed:  # raced with publish/shutdown
                        self._idle = False
                        continue
                    with contextlib.suppress(queue.Empty):
                        self._wakeup.get(timeout=idle_wait)
                    self._idle = False
                    continue
                wait = last_send + window - time.monotonic()
                flushing = self._closed or self._done + self._refused < self._flush_upto
                if wait > 0 and not flushing and len(pending) < self.max_merge:
                    # Sleep out the window, unless a full wire batch is ready already (a
                    # flush or shutdown cuts it short too).
                    with contextlib.suppress(queue.Empty):
                        self._wakeup.get(timeout=wait)
                    continue
                self._send(self._take(), encode)
                last_send = time.monotonic()
        finally:
            self._close_sockets(self._linger_ms)

    def _take(self) -> list[EventBatch]:
        """Pop the next run of batches to merge: in order, one rank, ``max_merge`` at most."""
        pending = self._pending
        first = pending.popleft()
        out = [first]
        rank = first.data_parallel_rank
        limit = self.max_merge
        while pending and len(out) < limit and pending[0].data_parallel_rank == rank:
            out.append(pending.popleft())
        return out

    def _send(self, batches: list[EventBatch], encode: Callable[[Any], bytes]) -> None:
        with self._lock:
            if self._skip:  # the gap a router must see for batches dropped on a full queue
                self._skip = False
                self._next_seq += 1
        seq = self._next_seq
        self._next_seq += 1
        try:
            payload = encode(_merge(batches))
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=len(payload) < _COPY_BELOW)
            self._buffer.append((seq, payload))
            self._published += 1
        except Exception:
            self._failed += len(batches)
            logger.exception("KV events: sending batch %d failed", seq)
        with self._done_cond:
            self._done += len(batches)
            self._done_cond.notify_all()

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()


__all__ = [
    "DEFAULT_BATCH_WINDOW_S",
    "DEFAULT_BUFFER_STEPS",
    "DEFAULT_HWM",
    "DEFAULT_MAX_MERGE",
    "DEFAULT_QUEUE_SIZE",
    "ZmqEventPublisher",
    "should_bind",
    "wants_ipv6",
]
