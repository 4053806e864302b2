"""A store's ``cuda_event`` is bytes from the client: the daemon opens it as a CUDA IPC event
handle and hands the event to its copy (a device-side wait). On a daemon that cannot open it
(no GPU here; garbage or truncated bytes on any machine) the store must be a typed reply that
copies nothing, and the daemon must keep serving its engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

from .conftest import raw_call

TOKENS = list(range(64))
BLOCKS = list(range(16))


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


HANDLES = {"zeros": b"\0" * 64, "ones": b"\xff" * 64, "short": b"x", "empty": b""}


@pytest.mark.parametrize("handle", list(HANDLES.values()), ids=list(HANDLES))
def test_a_store_with_an_event_the_daemon_cannot_open_copies_nothing(
    start_daemon: Callable[..., DaemonProcess], handle: bytes
) -> None:
    d = start_daemon()
    c, other = KVCacheClient(d.endpoint, 1, "m", timeout_s=5), KVCacheClient(d.endpoint, 2, "m", timeout_s=5)
    with c, other:
        c.register_kv_caches(_cache(1))
        other.register_kv_caches(_cache(2))
        store = m.Store(instance_id=1, token=c.session.token, token_ids=pack_ids(TOKENS),
                        block_ids=pack_ids(BLOCKS), cuda_event=handle)  # fmt: skip
        reply = raw_call(d.endpoint, store)
        assert isinstance(reply, m.Error), reply
        assert reply.code in (m.ErrorCode.CUDA_UNAVAILABLE, m.ErrorCode.CUDA), reply
        assert c.lookup(TOKENS) == 0  # nothing was reserved or copied
        assert other.store(TOKENS, BLOCKS).stored_tokens == 64  # the daemon serves the others
        assert c.lookup(TOKENS) == 64 and c.ping()
