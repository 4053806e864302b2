"""Instance identity: ids never collide silently and nobody acts for an instance it did not register.

Each test reproduces an observed failure against a real daemon process: two engines on
default settings, a second registration of a live id, raw requests naming another engine's
instance. The fixed behaviour: unique default ids, refused duplicates, tokens on every
byte-moving request, byte-exact isolation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import AccessDeniedError
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from tests.server.helpers import engine

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def test_two_default_clients_never_see_each_others_bytes(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    kv_a, kv_b = _cache(1), _cache(2)
    want_a, want_b = clone_caches(kv_a), clone_caches(kv_b)
    # Defaults everywhere but the endpoint: same model name, no instance id given.
    with KVCacheClient(d.ipc_endpoint, timeout_s=5) as a, KVCacheClient(d.ipc_endpoint, timeout_s=5) as b:
        assert a.instance_id != b.instance_id
        a.register_kv_caches(kv_a)
        b.register_kv_caches(kv_b)
        a.store(TOKENS, BLOCKS, cache_salt="a")
        b.store(TOKENS, BLOCKS, cache_salt="b")
        for t in kv_a + kv_b:
            t.zero_()
        assert a.retrieve(TOKENS, BLOCKS, cache_salt="a") == 64
        assert b.retrieve(TOKENS, BLOCKS, cache_salt="b") == 64
        assert caches_equal(kv_a, want_a) and caches_equal(kv_b, want_b)


def test_a_live_instance_id_cannot_be_taken_over(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    kv_a, kv_b = _cache(3), _cache(4)
    want_a = clone_caches(kv_a)
    with KVCacheClient(d.endpoint, 7, "m", timeout_s=5) as a, \
            KVCacheClient(d.endpoint, 7, "m", timeout_s=5) as b:  # fmt: skip
        a.register_kv_caches(kv_a)
        with pytest.raises(AccessDeniedError, match="another live client"):
            b.register_kv_caches(kv_b)
        # The first engine's later stores still copy its own bytes.
        a.store(TOKENS, BLOCKS)
        for t in kv_a:
            t.zero_()
        assert a.retrieve(TOKENS, BLOCKS) == 64
        assert caches_equal(kv_a, want_a)
        # The same client may register again (its earlier reply was lost, say).
        assert a.register_kv_caches(kv_a).instance_id == 7
        assert a.lookup(TOKENS) == 64


def test_raw_requests_for_another_instance_are_refused(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon(tcp=True)
    kv = _cache(5)
    with KVCacheClient(d.endpoint, 11, "victim", timeout_s=5) as victim:
        victim.register_kv_caches(kv)
        victim.store(TOKENS, BLOCKS)
        before = clone_caches(kv)
        ids = dict(token_ids=pack_ids(TOKENS), block_ids=pack_ids(BLOCKS))
        forged = [
            m.Retrieve(instance_id=11, **ids),  # would overwrite the victim's blocks
            m.Store(instance_id=11, token_ids=pack_ids(list(range(100, 164))), block_ids=ids["block_ids"]),
            m.Unregister(instance_id=11),
            m.Retrieve(instance_id=11, token=b"\0" * 16, **ids),  # a guessed token
            m.Unregister(instance_id=11, token=b"x"),
        ]
        for body in forged:
            reply = raw_call(d.endpoint, body)
            assert isinstance(reply, m.Error), body
            assert reply.code is m.ErrorCode.ACCESS_DENIED, (body, reply)
        assert caches_equal(kv, before)
        assert victim.lookup(list(range(100, 164))) == 0  # the forged store stored nothing
        assert victim.ping() is True  # still registered
        # A wrong token never keeps an instance alive, nor reveals it as registered.
        pong = raw_call(d.endpoint, m.Ping(instance_id=11, token=b"y" * 16))
        assert isinstance(pong, m.Pong) and not pong.registered


def test_a_lookup_without_the_token_is_allowed_for_the_same_principal(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A vLLM scheduler looks up the instance its worker registered, in another process."""
    d = start_daemon(tcp=True)
    with KVCacheClient(d.ipc_endpoint, 12, "m", timeout_s=5) as worker:
        worker.register_kv_caches(_cache(6))
        worker.store(TOKENS, BLOCKS)
        with KVCacheClient(d.ipc_endpoint, 12, "m", timeout_s=5) as scheduler:
            assert scheduler.lookup(TOKENS) == 64
            scheduler.end_session("r1")
        # Over TCP the peer is another principal ("loopback"): it needs the token.
        reply = raw_call(d.endpoint, m.Lookup(instance_id=12, token_ids=pack_ids(TOKENS)))
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.ACCESS_DENIED


def test_another_client_can_neither_keep_an_instance_alive_nor_list_it(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A dead engine's instance is reaped even while a stranger pings it and sends requests
    naming it; the daemon's status lists only the caller's own instances."""
    d = start_daemon("--heartbeat-timeout", "3", tcp=True)
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS.name
    dead = engine("kill_mid_store", d.ipc_endpoint, 21, "victim", fmt, seed=1)
    dead.wait(timeout=60)
    stranger = m.Ping(instance_id=21)  # over TCP: the "loopback" principal, not the victim's uid
    forged = m.Store(instance_id=21, token_ids=pack_ids(TOKENS), block_ids=pack_ids(BLOCKS))
    with KVCacheClient(d.ipc_endpoint, 22, "m", timeout_s=5) as owner:
        owner.register_kv_caches(_cache(7))
        assert 22 in owner.status()["instances"]
        assert 21 in owner.status()["instances"]  # same principal (this uid) as the dead engine
        deadline = time.monotonic() + 20
        while 21 in owner.status()["instances"]:
            assert time.monotonic() < deadline, "a stranger's pings kept a dead instance alive"
            pong = raw_call(d.endpoint, stranger)
            assert isinstance(pong, m.Pong) and not pong.registered
            reply = raw_call(d.endpoint, forged)
            # Refused; UNKNOWN_INSTANCE once the reaper took it since the status above.
            assert isinstance(reply, m.Error)
            assert reply.code in (m.ErrorCode.ACCESS_DENIED, m.ErrorCode.UNKNOWN_INSTANCE), reply
            time.sleep(0.1)  # a stranger's pace; the reaper is what is awaited
        hidden = raw_call(d.endpoint, m.Status())  # the owner's 22 is not the stranger's
        assert isinstance(hidden, m.StatusResult) and hidden.instances == []
