"""One frame within the message cap must not stall every other client.

Found by a hostile-client pass: the I/O thread decodes every frame itself, and the schema
bounded neither ``ReportBlockAllocations.records`` nor ``Register.tensors`` (their limits,
``max_report_records`` and ``--max-tensors``, are checked by the handler, after decoding). A
frame of about 55 MB holding a million empty records (or descriptors) took the decoder
seconds and hundreds of MB of Python objects, before anyone checked who sent it: a local user
over plain loopback TCP, with no instance and no token, froze the daemon for every engine
(pings, lookups, the replies of stores and retrieves) for as long as it kept sending. Now those
lists are bounded in the schema (``MAX_REGISTER_TENSORS``, ``MAX_REPORT_RECORDS``), as
``LookupBatch.items`` was, and the decoder refuses them in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import encode_request, pack_ids
from kvcache.records import MAX_NAME
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

from . import zmtp
from .conftest import raw_call

COUNT = 1_000_000


def _report() -> m.RequestBody:
    record = m.BlockAllocationRecord(req_id="", new_block_ids=[], new_token_ids=[])
    return m.ReportBlockAllocations(instance_id=1, records=[record] * COUNT)


def _register() -> m.RequestBody:
    desc = m.FdTensor(fd_index=0, offset=0, shape=[], stride=[], dtype="")
    return m.Register(instance_id=1, model_name="m", tensors=[desc] * COUNT)


FRAMES = {"block_report": _report, "register": _register}


@pytest.mark.parametrize("make", list(FRAMES.values()), ids=list(FRAMES))
def test_a_loopback_strangers_frame_does_not_freeze_the_daemon_for_everyone(
    start_daemon: Callable[..., DaemonProcess], make: Callable[[], m.RequestBody]
) -> None:
    d = start_daemon(tcp=True)
    assert d.ipc_endpoint != "off"
    frame = encode_request(7, make())
    assert len(frame) < m.DEFAULT_MAX_MESSAGE_BYTES  # within the daemon's message cap
    # The operator's engine is served normally before.
    t0 = time.monotonic()
    assert isinstance(raw_call(d.ipc_endpoint, m.Ping()), m.Pong)
    baseline = time.monotonic() - t0

    stranger = zmtp.connect(d.endpoint, timeout_s=60)  # plain loopback TCP: any local user
    try:
        zmtp.handshake(stranger)
        # Both frames are in once ``sendall`` returns: the daemon took all but a socket
        # buffer's worth, so its I/O thread is decoding them (or is done) when the ping comes.
        for _ in range(2):
            stranger.sendall(zmtp.frame_header(len(frame)) + frame)
        t0 = time.monotonic()
        pong = raw_call(d.ipc_endpoint, m.Ping(), timeout_ms=30_000)
        latency = time.monotonic() - t0
    finally:
        stranger.close()
    assert isinstance(pong, m.Pong)
    assert d.proc.poll() is None
    assert latency < 0.5, (
        f"a ping of the operator's engine took {latency:.2f} s (before: {baseline * 1000:.1f} ms) "
        "while the I/O thread decoded a stranger's frame"
    )


assert MAX_NAME == 1024  # the figures below are one past it

NAMES = {
    "lookup_request_id": lambda: m.Lookup(instance_id=1, token_ids=pack_ids([1]), request_id="r" * 1025),
    "lookup_cache_salt": lambda: m.Lookup(instance_id=1, token_ids=pack_ids([1]), cache_salt="s" * 1025),
    "end_session": lambda: m.EndSession(instance_id=1, request_id="r" * (MAX_NAME + 1)),
    "register_model_name": lambda: m.Register(instance_id=9, model_name="m" * (MAX_NAME + 1), tensors=[]),
    "report_req_id": lambda: m.ReportBlockAllocations(
        instance_id=1, records=[m.BlockAllocationRecord("r" * (MAX_NAME + 1), [0], [1])]
    ),
}


@pytest.mark.parametrize("make", list(NAMES.values()), ids=list(NAMES))
def test_a_name_past_the_bound_is_refused_and_the_engine_beside_it_is_served(
    start_daemon: Callable[..., DaemonProcess], make: Callable[[], m.RequestBody]
) -> None:
    """Request ids, salts and model names the daemon would keep (lifecycle state, hashers)
    are at most ``MAX_NAME`` characters: a longer one is ``BAD_MESSAGE`` from the decoder,
    nothing is registered, looked up or reported, and a registered engine is served on."""
    d = start_daemon()
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                  block_size=4, num_heads=2, head_size=8, dtype=torch.float16))  # fmt: skip
    with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(kv)
        c.store(list(range(64)), list(range(16)))
        reply = raw_call(d.ipc_endpoint, make())
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_MESSAGE, reply
        status = raw_call(d.ipc_endpoint, m.Status())
        assert isinstance(status, m.StatusResult) and status.instances == [1]
        assert c.lookup(list(range(64))) == 64
        assert d.proc.poll() is None
