"""A client that sends requests faster than it is served holds at most its in-flight budget.

The I/O loop reads every request as it arrives and queues it for a worker; a request that
waits (an await, a store waiting for room, copies in flight) stays held until its reply. A
client that pipelines without pause, or never reads its replies, grew the daemon by its whole
backlog (200 retrieves of 5 MB queued 1.6 GB). ``--max-in-flight-mb`` bounds the bytes of one
principal's requests read and not yet answered; past it a request is answered ``LIMIT`` at
once, and other principals are served as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.budget import REQUEST_FLOOR
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

from .conftest import raw_call

TOKENS, BLOCKS = list(range(128)), list(range(32))
BUDGET = 1 << 16  # 16 requests at the floor of 4 KiB each


def test_a_client_is_held_to_its_in_flight_budget_and_others_are_served(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-message-mb", "0.0625", "--max-in-flight-mb", "0.0625", tcp=True)
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32, block_size=4,
                                  num_heads=2, head_size=8, dtype=torch.float16, seed=1))  # fmt: skip
    with KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=10) as client:
        client.register_kv_caches(kv)
        assert client.store(TOKENS, BLOCKS).stored_chunks == 8
        # Retrieves awaiting chunks nobody stores: each is held (2 s) until its reply.
        held = m.Retrieve(instance_id=1, token_ids=pack_ids([t + 9000 for t in TOKENS]),
                          block_ids=pack_ids(BLOCKS), token=client.session.token,
                          await_chunks=8, await_ms=2000)  # fmt: skip
        sent = 40
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.ipc_endpoint)  # the same principal as ``client``: this uid
        try:
            for i in range(sent):
                sock.send(encode_request(i, held))
            refused: list[int] = []
            while len(refused) < sent - BUDGET // REQUEST_FLOOR:  # the refusals come at once
                assert sock.poll(1500), f"only {len(refused)} refused before the held ones end"
                reply = decode_reply(sock.recv())
                assert isinstance(reply.body, m.Error), reply.body
                assert reply.body.code is m.ErrorCode.LIMIT and "--max-in-flight-mb" in reply.body.message
                refused.append(reply.id)
            # Another principal (plain loopback TCP) is served while this one's budget is full.
            assert isinstance(raw_call(d.endpoint, m.Status()), m.StatusResult)
            answered = 0
            while answered < BUDGET // REQUEST_FLOOR:  # the held ones end at their await bound
                assert sock.poll(10_000), f"{answered} held retrieves answered"
                reply = decode_reply(sock.recv())
                assert isinstance(reply.body, m.RetrieveResult) and reply.body.retrieved_tokens == 0
                answered += 1
        finally:
            sock.close()
        # Every reply sent, the budget is whole again.
        assert client.retrieve(TOKENS, BLOCKS) == 128
    assert d.proc.poll() is None
