"""``ReplySender``: a reply the ROUTER cannot deliver is reported, counted by reason, never
blocks, and the counts are published once per batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvcache.observability.event import Event, EventType, ReplyDropped
from kvcache.server.delivery import GONE, UNREAD, ReplySender


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish(self, event: Event) -> None:
        self.events.append(event)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.SNDHWM, 1)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.ROUTING_ID, b"client")
    router.bind("inproc://delivery")
    dealer.connect("inproc://delivery")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def test_a_reply_to_an_unknown_client_is_counted_gone(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, _ = pair
    sender, bus = ReplySender(router), Recorder()
    assert sender.send([b"left-already", b"reply"]) is False
    sender.publish_dropped(bus)
    assert [(e.event_type, e.metadata) for e in bus.events] == [
        (EventType.REPLY_DROPPED, ReplyDropped(reason=GONE, count=1))
    ]
    sender.publish_dropped(bus)  # nothing new: nothing published
    assert len(bus.events) == 1


def test_replies_past_a_full_queue_are_counted_unread_without_blocking(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    dealer.send(b"hello")  # the router learns the client's identity
    assert router.poll(5000), "the client's hello never arrived"
    assert router.recv_multipart()[0] == b"client"
    sender, bus = ReplySender(router), Recorder()
    sent = sum(sender.send([b"client", b"reply %d" % i]) for i in range(100))  # never read
    assert 0 < sent < 100
    sender.publish_dropped(bus)
    assert [e.metadata for e in bus.events] == [ReplyDropped(reason=UNREAD, count=100 - sent)]
    assert dealer.poll(5000), "nothing queued was delivered"
    assert dealer.recv() == b"reply 0"  # what was queued is delivered
