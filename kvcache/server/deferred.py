"""Replies that come after their handler returned: store and retrieve answered on completion.

Separate from the handlers and the I/O loop because both ends of a deferred reply need the
same two small pieces: ``kvcache.futures.then`` turns the engine's future into a reply future
(on the thread that completes it), and ``Outbox`` carries the finished reply to the I/O thread from a thread
the daemon does not own (an engine completion thread), the one place a ZMQ socket is used from
more than one thread.
"""

from __future__ import annotations

import logging
import threading

import zmq

log = logging.getLogger("kvcache.server")


class Outbox:
    """A PUSH socket into the daemon's reply channel, shared by every thread that is not a worker.

    Workers each own a PUSH socket; a deferred reply is sent from the engine's completion
    thread, which comes and goes with its instance, so it cannot own one. ``send`` may be
    called from any thread: the lock serialises the socket's use, and its acquire/release is
    the full memory barrier ZMQ asks for when a socket moves between threads (zmq(7)). The
    high-water mark is off so a send never blocks a completion thread: replies are bounded
    by the requests in flight anyway. After ``close`` replies are dropped (the daemon has
    stopped waiting for them).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self._lock = threading.Lock()
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._closed = False

    def send(self, frames: list[bytes]) -> None:
        with self._lock:
            if self._closed:
                log.warning("a reply completed after the daemon stopped; dropped")
                return
            self._push.send_multipart(frames, copy=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=0)


__all__ = ["Outbox"]
