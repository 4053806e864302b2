"""Work a client gave up on never happens later: the daemon moves no byte past its deadline.

Observed before: with the daemon stalled (SIGSTOP), a store timed out at the client, and once
the daemon resumed it copied the engine's blocks anyway (by then another request's) and
served them under the first prompt; a late retrieve overwrote a live request's blocks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.protocol.errors import DaemonUnavailableError
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

from .helpers import BASE_ARGS

TOKENS, BLOCKS = list(range(64)), list(range(16))


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(BASE_ARGS)
    yield d
    os.kill(d.pid, signal.SIGCONT)
    d.kill()
    d.remove_runtime_dir()


def _cache(seed: int) -> list[torch.Tensor]:
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                    block_size=4, num_heads=2, head_size=8, dtype=torch.float16,
                                    seed=seed))  # fmt: skip


def _until(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_store_and_a_retrieve_timed_out_during_a_stall_never_happen(daemon: DaemonProcess) -> None:
    kv = _cache(1)
    with KVCacheClient(daemon.endpoint, 1, "m", timeout_s=0.5) as c, \
            KVCacheClient(daemon.endpoint, 2, "m", timeout_s=5) as other:  # fmt: skip
        c.register_kv_caches(kv)
        other.register_kv_caches(_cache(2))
        other.store(list(range(1000, 1064)), BLOCKS)  # something a retrieve could copy
        before = clone_caches(kv)
        os.kill(daemon.pid, signal.SIGSTOP)
        with pytest.raises(DaemonUnavailableError):
            c.store(TOKENS, BLOCKS)
        c.breaker.close()  # send the retrieve too, while still stalled
        with pytest.raises(DaemonUnavailableError):
            c.retrieve(list(range(1000, 1064)), BLOCKS)
        for t in kv:  # the engine reuses the blocks for another request
            t.add_(1)
        reused = clone_caches(kv)
        os.kill(daemon.pid, signal.SIGCONT)
        _until(lambda: not c.breaker.open, 10)
        c.timeout_s = 5
        assert other.lookup(TOKENS) == 0, "the late store was carried out"
        assert caches_equal(kv, reused), "the late retrieve overwrote reused blocks"
        assert not caches_equal(kv, before)


def test_a_request_past_its_deadline_is_refused_with_a_typed_error(daemon: DaemonProcess) -> None:
    with KVCacheClient(daemon.endpoint, 3, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache(3))
        late = m.Store(instance_id=3, token=c.session.token, token_ids=pack_ids(TOKENS),
                       block_ids=pack_ids(BLOCKS), deadline_ms=int((time.time() - 1) * 1000))  # fmt: skip
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        sock.send(encode_request(1, late))
        assert sock.poll(5000)
        reply = decode_reply(sock.recv()).body
        sock.close()
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.DEADLINE_EXCEEDED
        assert c.lookup(TOKENS) == 0
