"""A refused registration changes nothing: not even the live registration it would replace.

Found by a hostile-client pass: ``Handlers.register`` released a live instance registered
again by the same client (the registry record and the engine's instance) *before*
``CacheEngine.register`` checked the new request (chunk size, layout, format). A
re-registration the engine refused got a typed ``LAYOUT`` reply, yet the instance it named was
gone: its token no longer worked, and ``Status`` no longer listed it. Now the engine replaces
it (``register(replace=True)``) only once the new registration passed every check.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch

from kvcache.client import to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))
NONCE = secrets.token_bytes(16)


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
