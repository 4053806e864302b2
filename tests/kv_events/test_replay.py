"""The replay budget (``replay``): a token bucket on a fake clock, and on real sockets a reply
cut at a reader that asks and never reads (the daemon-level flood is in
tests/security/test_kv_events_replay.py)."""

from __future__ import annotations

import time

import pytest
import zmq

from kvcache.kv_events.messages import EventBatch, EventFactory, seq_bytes
from kvcache.kv_events.replay import ReplayBudget
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_pays_a_burst_then_its_rate() -> None:
    clock = Clock()
    budget = ReplayBudget(rate=10.0, capacity=50, clock=clock)
    assert budget.take(50) == 0.0  # one whole buffer at once
    assert budget.take(5) == pytest.approx(0.5)  # nothing spent: 5 tokens take 0.5 s
    clock.now += 0.5
    assert budget.take(5) == 0.0
    clock.now += 1000  # saved up no further than the capacity
    assert budget.take(50) == 0.0 and budget.take(1) > 0


def test_a_request_larger_than_the_capacity_is_charged_the_capacity() -> None:
    budget = ReplayBudget(rate=1.0, capacity=3, clock=Clock())
    assert budget.take(10) == 0.0  # else it would wait forever


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_a_rate_that_is_not_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="replay rate"):
        ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_rate=rate)


def test_a_reader_that_never_reads_has_its_replies_cut_not_queued() -> None:
    """A reply meets the reader's full queue (``SNDHWM``, one buffer): the rest of it is not
    sent (``ROUTER_MANDATORY``), counted as cut; the live stream is untouched."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=8, max_merge=1)
    f = EventFactory("map")
    big = list(range(200_000))  # ~1 MB a batch: the kernel's socket buffers fill after a few
    for i in range(8):
        stored = f.stored([i], block_size=16, medium="CPU", token_ids=big)
        pub.publish(EventBatch(ts=float(i), events=[stored]))
    assert pub.flush(30)
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.LINGER, 0)
    reader.connect(pub.replay_endpoint or "")
    try:
        for _ in range(20):
            reader.send(seq_bytes(0))
        deadline = time.monotonic() + 30
        while pub.replays_cut == 0:
            assert time.monotonic() < deadline, f"no reply cut after {pub.replay_requests} requests"
            time.sleep(0.01)
        assert pub.replayed_batches < 20 * 8  # what the cut replies did not send
    finally:
        reader.close()
        ctx.term()
        pub.shutdown()
