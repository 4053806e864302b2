"""The daemon end to end: real daemon and engine processes talking over real ZMQ sockets."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import UnknownInstanceError
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.protocol.errors import DaemonUnavailableError
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

from .helpers import engine, free_port, result, scrape

FA = "NL_X_TWO_NB_BS_NH_HS"  # vLLM FlashAttention, fp16
SGL = "TWO_X_NL_X_NBBS_NH_HS"  # SGLang MHA, bf16, flattened NB*BS


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_two_engines_with_different_layouts_round_trip_byte_exact(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    a = engine("roundtrip", d.endpoint, 1, "model-a", FA, seed=1)
    b = engine("roundtrip", d.endpoint, 2, "model-b", SGL, seed=2)
    ra, rb = result(a), result(b)
    for r in (ra, rb):
        assert r == {"event": "done", "stored_tokens": 256, "hit": 256, "got": 256, "exact": True}

    def both_reported() -> bool:
        text = scrape(d.metrics_url)
        counts = [
            _metric(text, "kvcache_l0_block_lifetime_seconds_count", instance_id=i, model_name=n)
            for i, n in (("1", "model-a"), ("2", "model-b"))
        ]
        return counts == [4.0, 4.0]  # same block ids, kept apart per instance

    _wait_for(both_reported, 10, "per-instance L0 lifecycle metrics")
    text = scrape(d.metrics_url)
    for i, n in (("1", "model-a"), ("2", "model-b")):
        assert _metric(text, "kvcache_store_stored_tokens_total", instance_id=i, model_name=n) == 256
    assert d.proc.poll() is None


def _raw_call(endpoint: str, *frames: bytes, timeout_ms: int = 5000) -> m.ReplyBody:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(timeout_ms), "no reply from the daemon"
        return decode_reply(sock.recv()).body
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ((b"\xc1garbage",), m.ErrorCode.BAD_MESSAGE),
        ((encode_request(5, m.Ping())[:-3],), m.ErrorCode.BAD_MESSAGE),  # truncated
        ((encode_request(5, m.Ping(), version=m.PROTOCOL_VERSION + 1),), m.ErrorCode.VERSION_MISMATCH),
        ((encode_request(5, m.Ping()), b"extra"), m.ErrorCode.BAD_MESSAGE),
        ((msgspec.msgpack.encode({"v": m.PROTOCOL_VERSION, "id": 1, "body": {"op": "unheard_of"}}),),
         m.ErrorCode.BAD_MESSAGE),
        ((encode_request(5, m.Lookup(instance_id=4242, token_ids=pack_ids([1]))),),
         m.ErrorCode.UNKNOWN_INSTANCE),
        ((encode_request(5, m.Store(instance_id=4242, token_ids=pack_ids([1]), block_ids=pack_ids([0]))),),
         m.ErrorCode.UNKNOWN_INSTANCE),
    ],
    ids=["garbage", "truncated", "version", "two-frames", "unknown-op", "unknown-lookup",
         "unknown-store"],
)  # fmt: skip
def test_bad_requests_get_typed_errors_and_the_daemon_stays_up(
    shared_daemon: DaemonProcess, frames: tuple[bytes, ...], code: m.ErrorCode
) -> None:
    reply = _raw_call(shared_daemon.endpoint, *frames)
    assert isinstance(reply, m.Error) and reply.code is code, reply
    assert "Traceback" not in reply.message
    assert isinstance(_raw_call(shared_daemon.endpoint, encode_request(6, m.Ping())), m.Pong)


def test_a_frame_over_the_message_cap_closes_its_connection(shared_daemon: DaemonProcess) -> None:
    """The frame cap is the message cap (issue 20, finding 3): libzmq drops the connection
    when the header announces more, before it buffers any of it; the daemon stays up."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(shared_daemon.endpoint)
    try:
        sock.send(b"x" * ((1 << 20) + 1))  # the shared daemon's cap is 1 MiB
        assert monitor.poll(5000), "the daemon kept a connection whose frame is over the cap"
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    assert isinstance(_raw_call(shared_daemon.endpoint, encode_request(6, m.Ping())), m.Pong)


def test_a_client_whose_request_is_over_the_cap_is_told_why(shared_daemon: DaemonProcess) -> None:
    chan = Channel(zmq.Context.instance(), shared_daemon.endpoint)
    try:
        huge = m.Lookup(instance_id=1, token_ids=pack_ids(range(1 << 19)))  # 2 MiB of ids
        with pytest.raises(DaemonUnavailableError, match=r"closed the connection.*--max-message-mb"):
            chan.call(huge, timeout_s=2)
        assert isinstance(chan.call(m.Ping(), timeout_s=5), m.Pong)
    finally:
        chan.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=st.binary(max_size=256) | st.builds(
    lambda body: msgspec.msgpack.encode({"v": m.PROTOCOL_VERSION, "id": 1, "body": body}),
    st.dictionaries(st.sampled_from(["op", "instance_id", "token_ids", "tensors", "records"]),
                    st.none() | st.integers(-(2**63), 2**63) | st.text(max_size=12) | st.binary(max_size=8)
                    | st.lists(st.integers(0, 2**32), max_size=3), max_size=4)))  # fmt: skip
def test_fuzzed_frames_over_the_socket_get_error_replies(shared_daemon: DaemonProcess, frame: bytes) -> None:
    reply = _raw_call(shared_daemon.endpoint, frame)
    assert isinstance(reply, (m.Error, m.Pong, m.StatusResult)), reply


def test_ragged_id_buffer_is_a_bad_request(shared_daemon: DaemonProcess) -> None:
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=1, num_blocks=4,
                                  block_size=4, head_size=8))  # fmt: skip
    with KVCacheClient(shared_daemon.endpoint, 21, "ragged", timeout_s=5) as c:
        c.register_kv_caches(kv)
        frame = encode_request(1, m.Lookup(instance_id=21, token_ids=m.IdArray(b"\x01\x02\x03", 4)))
        reply = _raw_call(shared_daemon.endpoint, frame)
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_REQUEST
        assert "whole number" in reply.message
        assert c.lookup(list(range(16))) == 0


def test_register_with_a_bad_descriptor_is_a_layout_error(shared_daemon: DaemonProcess) -> None:
    bogus = m.FdTensor(fd_index=0, offset=0, shape=[4], stride=[1], dtype="float16")  # no fds sent
    reply = _raw_call(
        shared_daemon.endpoint,
        encode_request(1, m.Register(instance_id=9, model_name="x", tensors=[bogus])),
    )
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LAYOUT


def test_unknown_instance_raises_the_same_exception_as_in_process(
    shared_daemon: DaemonProcess,
) -> None:
    with KVCacheClient(shared_daemon.endpoint, 31337, "nobody", timeout_s=5) as client:
        with pytest.raises(UnknownInstanceError, match="31337"):
            client.lookup(list(range(32)))
        with pytest.raises(UnknownInstanceError):
            client.report_block_allocations([])
        assert client.ping() is False


def test_client_killed_mid_store_leaves_whole_chunks_and_is_reaped(
    shared_daemon: DaemonProcess,
) -> None:
    ep = shared_daemon.endpoint
    victim = engine("kill_mid_store", ep, 11, "shared-model", FA, seed=7)
    assert victim.stdout is not None
    first = victim.stdout.readline()  # "registered"
    pid = int(re.search(r'"pid": (\d+)', victim.stdout.readline() or first)[1])  # type: ignore[index]
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL

    # Another instance of the same model and layout sees only whole chunks, byte-exact.
    r = result(engine("verify", ep, 12, "shared-model", FA, seed=7))
    assert r["exact"] is True
    assert r["got"] == r["hit"] and int(r["hit"]) % int(r["chunk_size"]) == 0  # type: ignore[call-overload]

    # The dead instance is released after the heartbeat timeout (its memfds went with it:
    # nothing is left in /dev/shm to clean up).
    with KVCacheClient(ep, 99, "observer", timeout_s=5) as observer:
        _wait_for(lambda: 11 not in observer.status()["instances"], 10, "instance 11 reaped")
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"kvcache-{pid}-")]
    assert "instance 11 (shared-model) sent nothing" in shared_daemon.log


def test_sigterm_during_traffic_exits_cleanly_and_restart_finds_disk_chunks(
    start_daemon: Callable[..., DaemonProcess], tmp_path: object
) -> None:
    runtime_dir = os.path.join(str(tmp_path), "run")  # the same ipc:// endpoint after the restart
    disk = ["--l2-disk-path", os.path.join(str(tmp_path), "l2"), "--l2-disk-size-gb", "0.1"]
    first = start_daemon(*disk, runtime_dir=runtime_dir)
    fmt = KVFormat.NL_X_NB_TWO_BS_NH_HS  # FlashInfer layout, this process's engine
    kv = to_shared(make_kv_caches(fmt, num_layers=2, num_blocks=16, block_size=4, head_size=8))
    expected = clone_caches(kv)
    tokens, blocks = list(range(64)), list(range(16))
    client = KVCacheClient(first.endpoint, 5, "persisted", timeout_s=5)
    client.register_kv_caches(kv)
    assert client.store(tokens, blocks).stored_tokens == 64

    traffic = engine("traffic", first.endpoint, 6, "busy", FA, seed=3, timeout=2.0)
    assert traffic.stdout is not None
    assert '"registered"' in traffic.stdout.readline()
    assert '"running"' in traffic.stdout.readline()
    assert first.stop(signal.SIGTERM, timeout_s=30) == 0
    assert "kvcache daemon stopped" in first.log
    summary = result(traffic)
    assert summary["other"] == 0, summary["errors"]
    assert int(summary["ok"]) >= 3  # type: ignore[call-overload]

    second = start_daemon(*disk, runtime_dir=runtime_dir)
    for t in kv:
        t.zero_()
    # The same client object: it re-registers with the new daemon by itself.
    hit = client.lookup_tiers(tokens)
    assert (hit.hit_tokens, hit.l2_hit_tokens) == (64, 64)  # from the disk tier
    assert client.retrieve(tokens, blocks) == 64
    assert caches_equal(kv, expected)  # byte-exact (random bytes include NaN patterns)
    client.close()
    assert second.stop() == 0


def test_kv_events_flag_publishes_the_engines_block_hashes(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    port = free_port()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")  # a plain host address: the daemon's PUB connects
    try:
        d = start_daemon("--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--kv-events-topic", "kv")
        kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                      block_size=4, head_size=8))  # fmt: skip
        with KVCacheClient(d.endpoint, 1, "events", timeout_s=5) as c:
            c.register_kv_caches(kv)
            deadline = time.monotonic() + 15
            for attempt in range(1000):  # until the subscription has reached the publisher
                hashes = [attempt * 100 + b for b in range(4)]
                c.store([attempt * 1000 + t for t in range(16)], list(range(4)), block_hashes=hashes)
                if sub.poll(100):
                    break
                assert time.monotonic() < deadline, "no KV event arrived"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        _ts, events, _rank = msgspec.msgpack.decode(payload)  # map form: events tagged by "type"
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored and stored[0]["block_size"] == 4  # the engine's block size, its own hashes
        first = stored[0]["block_hashes"][0]
        assert stored[0]["block_hashes"] == [first + b for b in range(4)] and first % 100 == 0
        assert d.stop() == 0
    finally:
        sub.close()
