"""Answering KV-event replay requests within a budget: ``ReplayServer``.

Apart from the publisher (``zmq_publisher``: the PUB socket, the queue, the thread) because a
replay request is a reader's bytes, and the cheapest to send of all: 8 bytes ask for up to the
whole buffer (``buffer_steps`` batches, 10,000 by default). Answered at once, a reader looping
on requests kept the publisher thread sending at full speed, and every send holds the GIL that
the daemon's request handlers need (measured: 320 requests against a full default buffer kept
a core busy for over a minute). So replays draw on a token bucket of ``rate`` batches a second,
whose burst is one whole buffer (a router catching up is answered at once). A request the
budget cannot pay for yet is held (one at a time); the ones behind it wait in the ROUTER
socket's own queues, bounded by its receive high-water mark and fair-queued across readers,
so one reader's flood delays another reader's replay by about one request, never more.

A reader that asks and does not read: its replies stop at the socket's send high-water mark
(``ROUTER_MANDATORY``: the send fails instead of being dropped silently) and the rest of that
reply is not sent (counted as cut), so its queue never holds more than one reply.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from kvcache.kv_events.messages import END_SEQ, seq_bytes, seq_from_bytes

logger = logging.getLogger("kvcache.kv_events.publisher")

DEFAULT_REPLAY_RATE = 10_000.0
"""Replayed batches a second, all readers together: at most about a tenth of a core (a replayed
batch cost ~11 us of Python on a loaded 2-core machine), while one full default buffer goes
out at once. Measured there, 16 readers x 20 requests against a full 10,000-batch buffer: 36 s
of CPU before the budget, 3.6 s in 120 s with it."""
_REPLAYS_PER_TURN = 4  # replay requests answered between two sends at most

Request = tuple[bytes, list[bytes], int]  # reader identity, envelope, first seq


class ReplayBudget:
    """A token bucket: ``rate`` tokens a second, at most ``capacity`` saved up."""

    def __init__(self, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or capacity < 1:
            raise ValueError(f"replay rate must be > 0 and capacity >= 1, got {rate!r}, {capacity!r}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = float(capacity)
        self._at = clock()

    def take(self, n: int) -> float:
        """Spend ``n`` tokens and return 0.0, or spend nothing and return the seconds until
        they are there (``n`` above ``capacity`` is charged as ``capacity``)."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        n = min(n, self.capacity)
        if self._tokens >= n:
            self._tokens -= n
            return 0.0
        return (n - self._tokens) / self.rate


class ReplayServer:
    """Answers replay requests on ``sock`` (a bound ROUTER) from ``buffer`` (``(seq, payload)``,
    oldest first), within ``budget``. Runs on the publisher thread only."""

    def __init__(
        self, sock: zmq.Socket[Any], topic: bytes, buffer: deque[tuple[int, bytes]], budget: ReplayBudget
    ) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone reader fails the send
        self._sock = sock
        self._topic = topic
        self._buffer = buffer
        self.budget = budget
        self._held: Request | None = None
        self.requests = 0
        """Requests taken (malformed ones too)."""
        self.malformed = 0
        self.cut = 0
        """Replies stopped early: their reader did not read (or left)."""
        self.batches = 0
        """Batches replayed."""

    def serve(self) -> float | None:
        """Answer up to a few requests (a few a turn, between sends: live batches come first).
        Returns 0.0 when more can be answered now, the seconds until the budget pays for the
        one held, or None when none is waiting."""
        for _ in range(_REPLAYS_PER_TURN):
            request = self._held or self._next()
            if request is None:
                return None
            wait = self.budget.take(self._cost(request[2]))
            if wait:
                self._held = request
                return wait
            self._held = None
            self._answer(*request)
        return 0.0 if self._sock.poll(0) else None

    def _next(self) -> Request | None:
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            self.requests += 1
            if len(frames) == 2:
                ident, envelope, start = frames[0], [], frames[1]
            elif len(frames) == 3 and frames[1] == b"":
                ident, envelope, start = frames[0], [b""], frames[2]
            else:
                self._malformed(f"{len(frames)} frames")
                continue
            if len(start) != 8:
                self._malformed(f"a start of {len(start)} bytes, not 8")
                continue
            return ident, envelope, seq_from_bytes(start)
        return None

    def _malformed(self, what: str) -> None:
        self.malformed += 1
        # One line, then debug: a reader's flood of junk must not become a flood of log lines.
        log = logger.warning if self.malformed == 1 else logger.debug
        log("KV events: ignoring a malformed replay request (%s; %d so far)", what, self.malformed)

    def _cost(self, first: int) -> int:
        """Batches the request will get at most (seqs are unique and rising): 1 at least,
        since even an empty answer costs a send."""
        if not self._buffer:
            return 1
        return max(1, min(len(self._buffer), self._buffer[-1][0] - first + 1))

    def _answer(self, ident: bytes, envelope: list[bytes], first: int) -> None:
        # vLLM's replay shape: [topic, seq, payload] per batch, then [b"", END_SEQ, b""].
        try:
            for seq, payload in list(self._buffer):
                if seq >= first:  # zero-copy: the frames keep the buffered bytes, not a copy
                    frames = [ident, *envelope, self._topic, seq_bytes(seq), payload]
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    self.batches += 1
            self._sock.send_multipart([ident, *envelope, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, errno.EHOSTUNREACH):
                raise
            self.cut += 1


__all__ = ["DEFAULT_REPLAY_RATE", "ReplayBudget", "ReplayServer"]
