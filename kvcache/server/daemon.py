"""The daemon's I/O loop: one ZMQ ROUTER, two lanes of worker threads, and a reaper.

Separate from the handlers (what each request does) and the CLI (how the process starts),
so that tests can run a daemon in a thread on an ephemeral port.

Threads and ordering:

* the **I/O thread** (whoever calls ``serve``) owns the ROUTER socket: it decodes each frame,
  answers undecodable ones itself, serves the operations that never wait on I/O (ping,
  reports, end session, and lookups unless a remote tier makes them wait on the network)
  inline, because a thread hand-off costs about as much as the lookup itself, and queues the
  rest on a lane;
* the **fast lane** (status, remote lookups) and the **bulk lane** (register, unregister,
  store, retrieve) each have their own threads, so a slow store never delays a lookup; each
  worker sends its reply back over its own inproc PUSH socket (ZMQ sockets are not
  thread-safe), and the I/O thread forwards it to the client;
* the **reaper** drops instances that sent nothing for ``heartbeat_timeout_s``.

Replies to one client may overtake each other; clients match them by request id.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from kvcache.protocol import messages as m
from kvcache.protocol.codec import DecodeFailure, decode_request, encode_reply
from kvcache.server.handlers import Handlers

log = logging.getLogger("kvcache.server")

_INLINE = (m.Ping, m.ReportBlockAllocations, m.EndSession)
_FAST = (m.Lookup, m.Status)
_STOP = None


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """How the daemon listens and schedules; storage settings live in ``EngineConfig``."""

    host: str = "127.0.0.1"
    port: int = 5555
    """0 picks a free port (``Daemon.endpoint`` tells which)."""
    allow_remote: bool = False
    """Binding a non-loopback address exposes the cache to the network; it must be asked for."""
    bulk_workers: int = 4
    fast_workers: int = 2
    heartbeat_timeout_s: float = 30.0
    max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES
    drain_timeout_s: float = 30.0
    """On shutdown, how long in-flight requests may take before the daemon stops anyway."""
    inline_lookups: bool = True
    """Serve lookups on the I/O thread; turn off when a lookup may wait on a network tier."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.bulk_workers < 1 or self.fast_workers < 1:
            raise ValueError("each worker lane needs at least one thread")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on non-loopback address {self.host!r}: anyone who can "
                "reach it can read and overwrite the cache; pass --allow-remote to do it anyway"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Daemon:
    """Serves ``Handlers`` over a ROUTER socket until ``request_stop`` (any thread, signals too)."""

    def __init__(self, config: DaemonConfig, handlers: Handlers) -> None:
        self.config = config
        self.handlers = handlers
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        # Hard cap well above the soft limit: past it ZMQ drops the peer instead of replying.
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes + 4096)
        host = f"[{config.host}]" if ":" in config.host else config.host
        try:
            self._router.bind(f"tcp://{host}:{config.port}")
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            self._ctx.term()
            raise OSError(
                f"cannot listen on tcp://{host}:{config.port}: {exc} "
                "(another kvcache daemon on that port? pick one with --port)"
            ) from None
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        if not is_loopback(config.host):
            log.warning("listening on %s: reachable from the network", self.endpoint)
        self._reply_addr = f"inproc://kvcache-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._reply_addr)
        self._stop = threading.Event()
        self._in_flight = 0
        self._lanes: dict[str, queue.SimpleQueue[tuple[bytes, int, m.RequestBody] | None]] = {
            "fast": queue.SimpleQueue(),
            "bulk": queue.SimpleQueue(),
        }
        self._threads: list[threading.Thread] = []
        self._inline_lookups = config.inline_lookups

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def request_stop(self) -> None:
        """Stop accepting work; ``serve`` returns once in-flight requests are answered."""
        self._stop.set()

    # -- threads -----------------------------------------------------------------------

    def _start_threads(self) -> None:
        sizes = {"fast": self.config.fast_workers, "bulk": self.config.bulk_workers}
        for lane, count in sizes.items():
            for i in range(count):
                # Daemon threads: a request stuck past the drain timeout must not block exit.
                t = threading.Thread(
                    target=self._work, args=(self._lanes[lane],), name=f"kvcache-{lane}-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)
        reaper = threading.Thread(target=self._reap, name="kvcache-reaper", daemon=True)
        reaper.start()

    def _work(self, lane: queue.SimpleQueue[tuple[bytes, int, m.RequestBody] | None]) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, -1)
        push.connect(self._reply_addr)
        try:
            while (item := lane.get()) is not _STOP:
                identity, request_id, body = item
                reply = self.handlers.handle(body)
                instance_id = getattr(body, "instance_id", None)
                if isinstance(instance_id, int):
                    self.handlers.registry.end(instance_id)
                push.send_multipart([identity, encode_reply(request_id, reply)], copy=False)
        finally:
            push.close()

    def _reap(self) -> None:
        period = min(1.0, self.config.heartbeat_timeout_s / 4)
        while not self._stop.wait(period):
            for instance in self.handlers.registry.pop_expired(self.config.heartbeat_timeout_s):
                try:
                    self.handlers.reap(instance)
                except Exception:
                    log.exception("failed to release instance %d", instance.instance_id)

    # -- the loop ----------------------------------------------------------------------

    def serve(self) -> None:
        """Run the I/O loop in the calling thread until stopped and drained."""
        self._start_threads()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        deadline: float | None = None
        try:
            while True:
                if self._stop.is_set() and deadline is None:
                    deadline = time.monotonic() + self.config.drain_timeout_s
                    log.info("stopping: finishing %d in-flight requests", self._in_flight)
                if deadline is not None and (self._in_flight == 0 or time.monotonic() > deadline):
                    break
                events = dict(poller.poll(100))
                if self._replies in events:
                    self._forward_replies()
                if self._router in events:
                    self._accept(draining=self._stop.is_set())
        finally:
            self._shutdown_threads(deadline)

    # NOTE: the loops below ask ZMQ_EVENTS whether a message is waiting rather than reading
    # until zmq.Again: an exception per wake-up costs more than the check, on every request.
    def _forward_replies(self) -> None:
        while int(self._replies.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = self._replies.recv_multipart(zmq.NOBLOCK, copy=False)
            self._in_flight -= 1
            self._router.send_multipart(frames, copy=False)

    def _accept(self, draining: bool) -> None:
        while int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            # Copying is cheaper than zero-copy frames at request sizes (a 32k-token lookup is
            # 128 KiB), and the decoder copies the byte fields anyway.
            frames = self._router.recv_multipart(zmq.NOBLOCK)
            identity = frames[0]
            if len(frames) != 2:
                error = m.Error(
                    code=m.ErrorCode.BAD_MESSAGE,
                    message=f"expected one frame per request, got {len(frames) - 1}",
                )
                self._reply_now(identity, 0, error)
                continue
            try:
                envelope = decode_request(frames[1], self.config.max_message_bytes)
            except DecodeFailure as failure:
                self._reply_now(identity, failure.request_id, failure.error)
                continue
            if draining:
                error = m.Error(code=m.ErrorCode.SHUTTING_DOWN, message="the daemon is stopping")
                self._reply_now(identity, envelope.id, error)
                continue
            body = envelope.body
            instance_id = getattr(body, "instance_id", None)
            if isinstance(body, _INLINE) or (self._inline_lookups and isinstance(body, m.Lookup)):
                reply = self.handlers.handle(body)
                self._router.send_multipart([identity, encode_reply(envelope.id, reply)])
                if isinstance(instance_id, int):
                    self.handlers.registry.touch(instance_id)
                continue
            if isinstance(instance_id, int):
                self.handlers.registry.begin(instance_id)
            lane = "fast" if isinstance(body, _FAST) else "bulk"
            self._in_flight += 1
            self._lanes[lane].put((identity, envelope.id, body))

    def _reply_now(self, identity: bytes, request_id: int, error: m.Error) -> None:
        self._router.send_multipart([identity, encode_reply(request_id, error)])

    def _shutdown_threads(self, deadline: float | None) -> None:
        self._stop.set()
        for lane, q in self._lanes.items():
            count = self.config.fast_workers if lane == "fast" else self.config.bulk_workers
            for _ in range(count):
                q.put(_STOP)
        for t in self._threads:
            t.join(None if deadline is None else max(0.1, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("%s still busy after the drain timeout; stopping without it", t.name)
        self._forward_replies()
        self._replies.close(linger=0)
        self._router.close()
        self._ctx.term()


__all__ = ["Daemon", "DaemonConfig", "is_loopback"]
