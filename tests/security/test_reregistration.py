"""A refused registration changes nothing: not even the live registration it would replace.

Found by a hostile-client pass: ``Handlers.register`` released a live instance registered
again by the same client (the registry record and the engine's instance) *before*
``CacheEngine.register`` checked the new request (chunk size, layout, format). A
re-registration the engine refused got a typed ``LAYOUT`` reply, yet the instance it named was
gone: its token no longer worked, and ``Status`` no longer listed it. Now the engine replaces
it (``register(replace=True)``) only once the new registration passed every check.

And a registration under an id that was unregistered keeps its own count of requests in
flight: the end of a request of the registration before no longer lowers it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import torch
import zmq

from kvcache.client import to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))
NONCE = secrets.token_bytes(16)
SLOW_LOOKUPS = 16
OLD_LOOKUPS = 4
AWAIT_MS = 6000


def test_a_refused_reregistration_leaves_the_live_registration_in_place(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()  # --chunk-size 16
    pong = raw_call(d.endpoint, m.Ping())
    assert isinstance(pong, m.Pong) and pong.fd_socket
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                  block_size=4, num_heads=2, head_size=8, dtype=torch.float16))  # fmt: skip
    descs, fds = memfd.export_cpu_tensors(kv)

    def register(**kwargs: object) -> m.ReplyBody:
        ticket = secrets.token_bytes(16)
        send_fds(pong.fd_socket, ticket, fds, 5.0)
        body = m.Register(instance_id=5, model_name="m", tensors=descs, fd_ticket=ticket,
                          client_nonce=NONCE, **kwargs)  # type: ignore[arg-type]  # fmt: skip
        return raw_call(d.endpoint, body)

    live = register()
    assert isinstance(live, m.Registered), live
    store = m.Store(instance_id=5, token=live.token, token_ids=pack_ids(TOKENS), block_ids=pack_ids(BLOCKS))
    stored = raw_call(d.endpoint, store)
    assert isinstance(stored, m.StoreResult) and stored.stored_tokens == 64, stored

    # The same client registers again, with a chunk size the daemon refuses (> --chunk-size).
    refused = register(chunk_size=32)
    assert isinstance(refused, m.Error) and refused.code is m.ErrorCode.LAYOUT, refused

    # Nothing changed: the live registration still answers to its token.
    status = raw_call(d.endpoint, m.Status())
    assert isinstance(status, m.StatusResult)
    assert status.instances == [5], status.instances
    hit = raw_call(d.endpoint, m.Lookup(instance_id=5, token=live.token, token_ids=pack_ids(TOKENS)))
    assert isinstance(hit, m.LookupResult) and hit.hit_tokens == 64, hit


def test_requests_of_an_unregistered_registration_never_uncount_the_next_one(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A client unregisters while lookups of its registration still queue, registers the
    same id again and starts a retrieve that waits for chunks nobody stores, then stays
    silent. The old lookups' ends must lower the count of the registration they were counted
    on, not the new one's: the new registration has its retrieve in flight, so ``Status``
    counts it and the reaper leaves the registration alone until it ends at its await bound.

    Observed before: the old lookups' ends took the retrieve off the new registration's
    count (``Status.in_flight`` 0), and the reaper dropped the registration a heartbeat
    timeout later, cutting the retrieve short (answered at 2.5 s of its 6)."""
    d = start_daemon("--workers", "1", "--fast-workers", "1", "--heartbeat-timeout", "1")
    pong = raw_call(d.endpoint, m.Ping())
    assert isinstance(pong, m.Pong) and pong.fd_socket
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                  block_size=4, num_heads=2, head_size=8, dtype=torch.float16))  # fmt: skip
    descs, fds = memfd.export_cpu_tensors(kv)

    def register(instance_id: int) -> m.Register:
        ticket = secrets.token_bytes(16)
        send_fds(pong.fd_socket, ticket, fds, 5.0)
        return m.Register(instance_id=instance_id, model_name="m", tensors=descs, fd_ticket=ticket,
                          client_nonce=NONCE)  # fmt: skip

    first = raw_call(d.endpoint, register(5))
    busy = raw_call(d.endpoint, register(6))  # whose lookups keep the one fast worker busy
    assert isinstance(first, m.Registered) and isinstance(busy, m.Registered), (first, busy)
    again = register(5)  # its descriptors handed over now: nothing below waits for them
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)  # ipc://: the same principal (this uid) as ``raw_call``'s
    replies: dict[int, m.ReplyBody] = {}

    def reply_to(request_id: int, timeout_s: float = 10.0) -> m.ReplyBody:
        deadline = time.monotonic() + timeout_s
        while request_id not in replies:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"no reply to {request_id}"
            reply = decode_reply(sock.recv())
            replies[reply.id] = reply.body
        return replies.pop(request_id)

    try:
        # Long lookups of instance 6 (~50 ms each), then lookups counted on the first
        # registration of 5 (more than 64 Ki tokens: the fast lane), served after them.
        slow = m.Lookup(instance_id=6, token_ids=pack_ids(range(1 << 20)))
        for i in range(SLOW_LOOKUPS):
            sock.send(encode_request(100 + i, slow))
        old = m.Lookup(instance_id=5, token_ids=pack_ids(range(1 << 17)))
        for i in range(OLD_LOOKUPS):
            sock.send(encode_request(200 + i, old))
        sock.send(encode_request(1, m.Unregister(instance_id=5, token=first.token)))
        sock.send(encode_request(2, again))  # one bulk worker: after the unregister
        assert isinstance(reply_to(1), m.Done)
        second = reply_to(2)
        assert isinstance(second, m.Registered), second
        held = m.Retrieve(instance_id=5, token=second.token, token_ids=pack_ids([t + 9000 for t in TOKENS]),
                          block_ids=pack_ids(BLOCKS), await_chunks=4, await_ms=AWAIT_MS)  # fmt: skip
        sent = time.monotonic()
        sock.send(encode_request(3, held))
        for i in range(SLOW_LOOKUPS):
            assert isinstance(reply_to(100 + i), m.LookupResult)
        for i in range(OLD_LOOKUPS):  # served for the second registration (no token needed)
            assert isinstance(reply_to(200 + i), m.LookupResult)
        status = raw_call(d.endpoint, m.Status())
        assert isinstance(status, m.StatusResult)
        assert 5 in status.instances and status.in_flight == 1, status  # the held retrieve
        # Past the heartbeat timeout and a reaper round: the retrieve alone keeps 5 registered.
        # A sleep on purpose: what is checked is that nothing happens (no reaping) while time
        # passes; no event marks a reaper round that left an instance alone.
        time.sleep(max(0.0, sent + 2.5 - time.monotonic()))
        assert time.monotonic() - sent < AWAIT_MS / 1000 - 1, "the lookups outlasted the test's window"
        status = raw_call(d.endpoint, m.Status())
        assert isinstance(status, m.StatusResult)
        assert 5 in status.instances and status.in_flight == 1, status
        done = reply_to(3)
        assert isinstance(done, m.RetrieveResult) and done.retrieved_tokens == 0, done
        assert time.monotonic() - sent >= AWAIT_MS / 1000 - 0.1, "cut short"  # waited its bound
    finally:
        sock.close()
