"""Replies handed to the ROUTER socket, and the ones it refused, counted by reason.

Apart from the loop (``daemon``) because it is one fact with its own rules: ZMQ's ROUTER drops
a message it cannot route without a word, to a client that left or to one whose queue of
unread replies is full (the socket's high-water mark, about 1,000 per connection, plus what the
kernel's socket buffers hold). The daemon must not hold more for a client that never reads (its
memory would be the client's to grow), but a silent drop hid both from the operator: the
client's calls timed out and nothing said why. With ``ROUTER_MANDATORY`` the socket refuses
each instead, and never blocks the I/O thread, since every send here is non-blocking: a refused
reply is counted (``unread`` or ``gone``) and published in batches by the daemon's loop
(``REPLY_DROPPED``), as refused requests are.

The count is a lower bound on the replies lost: it counts every reply the socket refuses, not
the ones it accepted. Replies queued for a connection that then closes (up to its high-water
mark plus the kernel's buffers), and replies sent before the socket notices a close, are
discarded by libzmq with no error, so they are lost uncounted.
"""

from __future__ import annotations

import errno
from collections import Counter
from typing import Any

import zmq

from kvcache.observability.event import Event, EventSink, EventType, ReplyDropped

UNREAD = "unread"
"""The client's queue of unread replies was full (it reads slower than it asks), including a
client that left with a full queue: libzmq's router checks for a full queue before a closing
connection, and keeps the connection's pipe until it reads the pipe's end marker."""
GONE = "gone"
"""The socket had no connection for the client: it had left with room in its queue (or never
connected)."""


class ReplySender:
    """Sends on the daemon's ROUTER, counting what it could not deliver. I/O thread only, like
    the socket itself."""

    def __init__(self, router: zmq.Socket[Any]) -> None:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # report, do not silently drop
        self._router = router
        self._dropped: Counter[str] = Counter()

    def send(self, frames: list[Any]) -> bool:
        """Send one reply (identity frame first); False, counted, when it could not be."""
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._dropped[UNREAD] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._dropped[GONE] += 1
            return False
        return True

    def publish_dropped(self, bus: EventSink) -> None:
        """Publish the drops counted since the last call, one event per reason."""
        if not self._dropped:  # the loop asks every turn
            return
        dropped, self._dropped = self._dropped, Counter()
        for reason, count in dropped.items():
            bus.publish(Event(EventType.REPLY_DROPPED, ReplyDropped(reason=reason, count=count)))


__all__ = ["GONE", "UNREAD", "ReplySender"]
