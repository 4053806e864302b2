"""ZmqEventPublisher over real sockets: frames, seq continuity, merging, replay, bounded buffer, drops.

The replay tests use ``max_merge=1`` (one wire batch per published batch) so they can count
wire batches; merging itself is tested on its own and by the router-follows-engine test,
which runs with the defaults.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvcache.kv_events.factory import default_factory
from kvcache.kv_events.messages import END_SEQ, EventBatch, EventFactory
from kvcache.kv_events.publisher import NullEventPublisher
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher
from tests.kv_events.router import Consumer, GapError, wait_connected

LOCAL = "tcp://127.0.0.1:*"


def batch(fmt: str, i: int) -> EventBatch:
    f = EventFactory(fmt)  # type: ignore[arg-type]
    return EventBatch(ts=float(i), events=[f.stored([i], block_size=16, medium="CPU")])


@pytest.fixture
def pub() -> Iterator[ZmqEventPublisher]:
    p = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", max_merge=1)
    yield p
    p.shutdown()


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_frames_seq_and_both_formats_decode(fmt: str) -> None:
    pub = ZmqEventPublisher(LOCAL, topic="kv-events", data_parallel_rank=3)
    c = Consumer(pub.endpoint, None, fmt=fmt, topic="kv-events")
    try:
        first = wait_connected(lambda: pub.publish(EventBatch(0.0, [])), c)
        for i in range(20):
            pub.publish(batch(fmt, i))
        assert pub.flush(5)
        c.follow_until(pub.published_batches - 1)
        assert c.topics == {b"kv-events"}
        seqs = [s for s, _ in c.batches]
        assert seqs == list(range(first + 1, pub.published_batches))  # continuous, no duplicates
        assert [e.block_hashes for _, b in c.batches for e in b.events] == [[i] for i in range(20)]
        assert all(b.data_parallel_rank == 3 for _, b in c.batches)
        assert c.held["CPU"] == set(range(20))
    finally:
        c.close()
        pub.shutdown()


def test_batches_within_the_window_merge_in_order_and_flush_cuts_the_window_short() -> None:
    pub = ZmqEventPublisher(LOCAL, topic="kv", batch_window_s=30.0, max_merge=3)
    c = Consumer(pub.endpoint, None, topic="kv")
    f = EventFactory("map")
    try:

        def probe() -> None:  # flushed: a probe must not wait out the 30 s window
            pub.publish(EventBatch(0.0, []))
            pub.flush(5)

        first = wait_connected(probe, c)
        t0 = time.perf_counter()
        two = [f.stored([10], block_size=16, medium="CPU"), f.removed([10], medium="CPU")]
        pub.publish(EventBatch(1.0, two))  # one operation, two events: never split
        for i in range(2, 6):
            pub.publish(EventBatch(float(i), [f.stored([10 * i], block_size=16, medium="CPU")]))
        pub.publish(EventBatch(6.0, [f.stored([60], block_size=16, medium="CPU")], data_parallel_rank=1))
        assert pub.queue_depth > 0
        assert pub.flush(5)
        assert time.perf_counter() - t0 < 10  # flush did not wait for the window
        assert pub.queue_depth == 0
        c.follow_until(pub.published_batches - 1)
        got = [b for s, b in c.batches if s > first and b.events]
        # max_merge=3 splits the 5 rank-0 batches 3 + 2; the rank-1 batch travels alone.
        assert [len(b.events) for b in got] == [4, 2, 1]
        assert [b.ts for b in got] == [3.0, 5.0, 6.0]  # a merged batch has its last ts
        assert [b.data_parallel_rank for b in got] == [0, 0, 1]
        flat = [(type(e).__name__, e.block_hashes) for b in got for e in b.events]
        assert flat == [("BlockStored", [10]), ("BlockRemoved", [10]),
                        *[("BlockStored", [10 * i]) for i in range(2, 7)]]  # fmt: skip
    finally:
        c.close()
        pub.shutdown()


def test_shutdown_sends_what_waits_in_the_window() -> None:
    pub = ZmqEventPublisher(LOCAL, batch_window_s=30.0)
    pub.publish(batch("map", 0))
    assert pub.flush(5)
    for i in range(1, 4):
        pub.publish(batch("map", i))
    t0 = time.perf_counter()
    pub.shutdown()
    assert time.perf_counter() - t0 < 5
    assert (pub.published_batches, pub.queue_depth, pub.dropped_batches) == (2, 0, 0)


def test_seq_starts_at_zero_and_late_joiner_recovers_by_replay(pub: ZmqEventPublisher) -> None:
    for i in range(5):  # nobody listens yet: PUB drops these
        pub.publish(batch("map", i))
    assert pub.flush(5)
    c = Consumer(pub.endpoint, pub.replay_endpoint, topic="kv")
    try:
        wait_connected(lambda: pub.publish(EventBatch(0.0, [])), c)
        c.next_seq = 0  # a router that must know everything from the start
        pub.publish(batch("map", 99))
        while c.poll(100) is False:
            pass
        assert c.gaps_recovered == 1
        assert [s for s, _ in c.batches][:5] == [0, 1, 2, 3, 4]
        assert c.held["CPU"] >= {0, 1, 2, 3, 4}
        c.follow_until(pub.published_batches - 1)
        assert [s for s, _ in c.batches] == list(range(pub.published_batches))
        assert 99 in c.held["CPU"]
    finally:
        c.close()


def test_gap_from_a_slow_subscriber_is_recovered_by_replay() -> None:
    pub = ZmqEventPublisher(LOCAL, LOCAL, hwm=10, max_merge=1)
    c = Consumer(pub.endpoint, pub.replay_endpoint)
    c.sub.setsockopt(zmq.RCVHWM, 10)
    try:
        first = wait_connected(lambda: pub.publish(EventBatch(0.0, [])), c)
        n = 3000
        for i in range(n):  # the consumer does not read: the HWMs overflow and ZMQ drops
            pub.publish(batch("map", i))
        assert pub.flush(10)
        c.follow_until(first + n)
        assert c.gaps_recovered >= 1
        assert [s for s, _ in c.batches] == list(range(first + 1, first + n + 1))
        assert c.held["CPU"] == set(range(n))
    finally:
        c.close()
        pub.shutdown()


def test_replay_buffer_is_bounded_and_an_unfillable_gap_is_reported() -> None:
    pub = ZmqEventPublisher(LOCAL, LOCAL, buffer_steps=3, max_merge=1)
    for i in range(10):
        pub.publish(batch("map", i))
    assert pub.flush(5)
    c = Consumer(pub.endpoint, pub.replay_endpoint)
    try:
        assert pub.buffered_batches == 3
        assert c.replay_from(0) == [7, 8, 9]
        assert c.next_seq == 0  # nothing applied: 0..6 are gone
        wait_connected(lambda: pub.publish(EventBatch(0.0, [])), c)
        c.next_seq = 0
        pub.publish(batch("map", 10))
        with pytest.raises(GapError):
            while not c.poll(100):
                pass
    finally:
        c.close()
        pub.shutdown()


def test_plain_dealer_without_delimiter_gets_bare_replies(pub: ZmqEventPublisher) -> None:
    for i in range(3):
        pub.publish(batch("map", i))
    assert pub.flush(5)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint or "")
    try:
        d.send((1).to_bytes(8, "big"))
        replies = []
        while True:
            assert d.poll(5000)
            frames = d.recv_multipart()
            replies.append(frames)
            if frames[1] == END_SEQ:
                break
        assert [int.from_bytes(f[1], "big", signed=True) for f in replies] == [1, 2, -1]
        assert [f[0] for f in replies] == [b"kv", b"kv", b""]  # the topic, as vLLM sends it
        assert replies[-1][2] == b""
        decoded = msgspec.msgpack.decode(replies[0][2])
        assert decoded[1][0]["block_hashes"] == [1]
        d.send_multipart([b"", b"short"])  # malformed: ignored, the socket keeps working
        d.send((2).to_bytes(8, "big"))
        assert d.poll(5000)
        assert int.from_bytes(d.recv_multipart()[1], "big") == 2
    finally:
        d.close(0)
        ctx.term()


def test_full_queue_drops_and_counts_but_never_blocks_or_raises() -> None:
    pub = ZmqEventPublisher(LOCAL, LOCAL, max_queue_size=1, buffer_steps=20_000)
    n = 20_000
    t0 = time.perf_counter()
    for i in range(n):
        pub.publish(EventBatch(float(i), []))
    elapsed = time.perf_counter() - t0
    assert pub.flush(10)
    c = Consumer(pub.endpoint, pub.replay_endpoint)
    try:
        seqs = c.replay_from(0)
    finally:
        c.close()
    pub.shutdown()
    assert pub.dropped_batches > 0
    # A queue of one never holds two batches to merge: every survivor is one wire batch.
    assert pub.published_batches + pub.dropped_batches == n
    assert elapsed < 2.0
    # Each run of drops consumed a seq: a router sees a gap that replay cannot fill.
    assert len(seqs) == pub.published_batches and seqs == sorted(set(seqs))
    assert seqs[-1] + 1 > len(seqs)
    pub.publish(EventBatch(0.0, []))  # after shutdown: ignored, no exception


def test_factory_null_default_duplicates_and_unknown_kinds() -> None:
    factory = default_factory()
    assert isinstance(factory.create(None), NullEventPublisher)
    assert isinstance(factory.create("null"), NullEventPublisher)
    with pytest.raises(ValueError, match="already registered"):
        factory.register("zmq", ZmqEventPublisher)
    with pytest.raises(ValueError, match="'kafka'"):
        factory.create("kafka")
    null = NullEventPublisher()
    null.publish(EventBatch(0.0, []))
    null.shutdown()
    assert (null.published_batches, null.dropped_batches, null.queue_depth) == (0, 0, 0)


def test_bad_endpoint_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot open"):
        ZmqEventPublisher("bogus://*:1")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_ipv6_loopback_binds_and_delivers() -> None:
    """``tcp://[::1]:N`` is the loopback TCP bind for the PUB (a plain IPv4 host connects)."""
    p = ZmqEventPublisher("tcp://[::1]:*", "tcp://[::1]:*", topic="kv", max_merge=1)
    c = Consumer(p.endpoint, p.replay_endpoint, topic="kv")
    try:
        assert p.endpoint.startswith("tcp://[::1]:") and p.replay_endpoint is not None
        wait_connected(lambda: p.publish(EventBatch(0.0, [])), c)
        p.publish(batch("map", 7))
        assert p.flush(5)
        c.follow_until(p.published_batches - 1)
        assert 7 in c.held["CPU"]
        assert c.replay_from(0) == list(range(p.published_batches))  # the replay socket too
    finally:
        c.close()
        p.shutdown()


def test_a_reader_flooding_replay_requests_never_holds_back_live_batches() -> None:
    """Replay requests are a reader's bytes: one that sends hundreds (and reads none of the
    replies) must not keep the publisher thread replaying while live batches wait. Requests
    are served a few at a time between sends, so the live batch published once the flood is
    being served goes out long before the flood is done; an oversized request frame is
    refused by the socket (``ZMQ_MAXMSGSIZE``), and the socket keeps serving."""
    p = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", max_merge=1, buffer_steps=500)
    live = Consumer(p.endpoint, None, topic="kv")
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.connect(p.replay_endpoint or "")
    try:
        wait_connected(lambda: p.publish(EventBatch(ts=0.0, events=[])), live)
        for i in range(500):
            p.publish(batch("map", i))
        assert p.flush(10)
        big_ctx = zmq.Context()  # past the frame bound: this connection is dropped
        big = big_ctx.socket(zmq.DEALER)
        big.connect(p.replay_endpoint or "")
        big.send(b"x" * 100_000)
        big.close(linger=5000)
        big_ctx.term()  # returns once the frame is on its way
        requests = 200
        for _ in range(requests):
            flood.send((0).to_bytes(8, "big"))
        deadline = time.monotonic() + 30
        while p.replay_requests_served == 0:
            assert time.monotonic() < deadline, "the flood was never served"
            time.sleep(0.001)
        p.publish(batch("map", 777))
        while True:
            assert live.sub.poll(30_000), "the live batch never came"
            _, _, payload = live.sub.recv_multipart()
            if msgspec.msgpack.decode(payload)[1][0]["block_hashes"] == [777]:
                break
        assert p.replay_requests_served < requests / 2, p.replay_requests_served
        while p.replay_requests_served < requests:  # the rest of the flood is served after
            assert time.monotonic() < deadline, p.replay_requests_served
            time.sleep(0.005)
        assert p.replay_requests_served == requests  # the oversized frame never reached it
    finally:
        flood.close(0)
        ctx.term()
        live.close()
        p.shutdown()


def test_a_reader_that_lags_still_gets_a_whole_replay_and_its_end_marker() -> None:
    """A replay longer than ZMQ's default queue (1,000 messages) to a reader that reads
    nothing while it is sent: the publisher queues all of it, so once the reader reads, every
    batch and the end marker are there. With ZMQ's default on the publisher's side, the tail
    was dropped, end marker included, and the reader waited for it in vain."""
    n = 3000
    p = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", max_merge=1, buffer_steps=n)
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 10)  # a reader that lags: its own queue holds ten
    reader.connect(p.replay_endpoint or "")
    try:
        f = EventFactory("map")
        hashes = list(range(10_000))  # ~30 KB a batch, 90 MB in all: past the kernel buffers
        for i in range(n):
            p.publish(EventBatch(ts=float(i), events=[f.stored(hashes, block_size=16, medium="CPU")]))
        assert p.flush(30)
        reader.send((0).to_bytes(8, "big"))
        deadline = time.monotonic() + 30
        while p.replay_requests_served == 0:  # the whole replay is handed to ZMQ in one turn
            assert time.monotonic() < deadline, "the replay was never served"
            time.sleep(0.001)
        seqs: list[int] = []
        while True:
            assert reader.poll(5_000), f"no end marker after {len(seqs)} batches"
            _, seq, _ = reader.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(n))
    finally:
        reader.close(0)
        ctx.term()
        p.shutdown()
