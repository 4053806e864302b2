"""The contract of a KV-event publisher (``EventPublisher``) and its null twin.

Separate from the bus subscriber that builds the batches (``subscriber.py``) so the socket
side can be tested, swapped or reused (a framework may publish its own batches) on its own.
The ZMQ publisher is in ``zmq_publisher``; ``factory`` picks one by name.

Ordering promise of every publisher: events go out in the order ``publish`` accepted their
batches, and the events of one accepted batch always travel together in one wire batch
(one sequence number). A publisher may merge several accepted batches, in order, into one
wire batch (vLLM itself sends a whole scheduler step as one): per-message costs (a thread
wake-up, an encode, a send, a wake-up of the router) then scale with messages, not with
engine operations. ``publish`` never blocks and never raises; a batch that finds the queue
full is dropped and counted, and a sequence number is *consumed* for it, so a subscriber
sees the gap, finds that replay cannot fill it, and knows to resynchronise.
"""

from __future__ import annotations

import abc

from kvcache.kv_events.messages import EventBatch


class EventPublisher(abc.ABC):
    """Sends ``EventBatch`` objects to routers; see the module docstring for the ordering promise."""

    @abc.abstractmethod
    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; never blocks, never raises (drops are counted)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then release sockets and threads; idempotent."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch accepted before the call was sent or dropped; False on timeout."""
        return True

    @property
    def published_batches(self) -> int:
        """Wire batches sent (sequence numbers used by a send)."""
        return 0

    @property
    def dropped_batches(self) -> int:
        """Accepted batches that never went out (queue full or send failed)."""
        return 0

    @property
    def queue_depth(self) -> int:
        """Accepted batches waiting for the publisher thread."""
        return 0

    @property
    def replay_requests(self) -> int:
        """Replay requests taken from readers (malformed ones too)."""
        return 0

    @property
    def replayed_batches(self) -> int:
        """Batches sent in answer to replay requests."""
        return 0

    @property
    def replays_cut(self) -> int:
        """Replay answers stopped early because their reader did not read them (or left)."""
        return 0


REPLAY_METRICS = (  # the publisher's replay counters as metrics: property, metric, help
    ("replay_requests", "kvcache_kv_events_replay_requests_total", "KV-event replay requests taken."),
    ("replayed_batches", "kvcache_kv_events_replayed_batches_total", "KV-event batches sent as replays."),
    ("replays_cut", "kvcache_kv_events_replays_cut_total", "Replays stopped: the reader did not read."),
)


class NullEventPublisher(EventPublisher):
    """What you get when KV events are off: ``publish`` is one empty call."""

    def publish(self, batch: EventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None


__all__ = ["REPLAY_METRICS", "EventPublisher", "NullEventPublisher"]
