"""Each request handler against a real CacheEngine, without sockets."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.errors import UnknownInstanceError
from kvcache.layouts import KVFormat
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.auth import Principal
from kvcache.server.fdinbox import FdInbox
from kvcache.server.handlers import Handlers
from kvcache.server.registry import InstanceRegistry
from kvcache.testing import ENGINE_OF, make_kv_caches
from kvcache.transport.fdpass import send_fds
from kvcache.transport.memfd import to_shared
from kvcache.transport.tensors import export_tensors


@pytest.fixture
def handlers(tmp_path: Path) -> Iterator[Handlers]:
    engine = CacheEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    inbox = FdInbox(str(tmp_path / "fds.sock"), frozenset({os.getuid()}))
    inbox.start()
    yield Handlers(engine, InstanceRegistry(), heartbeat_timeout_s=7.0, fd_inbox=inbox)
    inbox.close()
    engine.close()


def _register(handlers: Handlers, leaves: list[torch.Tensor], **fields: Any) -> m.Register:
    """A ``Register`` for ``leaves`` whose memfds were really handed over to the inbox."""
    descs, fds = export_tensors(leaves)
    ticket = secrets.token_bytes(16)
    assert handlers.fd_inbox is not None
    send_fds(handlers.fd_inbox.path, ticket, fds, 5.0)
    return m.Register(**{"tensors": descs, "fd_ticket": ticket, **fields})


@pytest.mark.parametrize(
    "fmt",
    [KVFormat.NB_NL_TWO_BS_NH_HS, KVFormat.NL_X_NB_TWO_BS_NH_HS,
     KVFormat.TWO_X_NL_X_NBBS_NH_HS, KVFormat.NL_X_NBBS_ONE_HS],
)  # fmt: skip
def test_register_rebuilds_every_nesting(handlers: Handlers, fmt: KVFormat) -> None:
    kv = to_shared(make_kv_caches(fmt, num_layers=2, num_blocks=8, block_size=4, head_size=8))
    leaves = [kv] if isinstance(kv, torch.Tensor) else (
        list(kv) if isinstance(kv[0], torch.Tensor) else [t for g in kv for t in g])  # fmt: skip
    nesting = "tensor" if isinstance(kv, torch.Tensor) else ("list" if isinstance(kv[0], torch.Tensor)
                                                              else "nested")  # fmt: skip
    groups = [len(g) for g in kv] if nesting == "nested" else []
    reply = handlers.handle(_register(handlers, leaves, instance_id=1, model_name="m", nesting=nesting,
                                      group_sizes=groups, engine=ENGINE_OF[fmt], block_size=4))  # fmt: skip
    assert isinstance(reply, m.Registered), reply
    assert (reply.fmt, reply.num_layers, reply.num_blocks, reply.block_size) == (fmt.name, 2, 8, 4)
    assert reply.heartbeat_timeout_s == 7.0
    tokens = pack_ids(range(32))
    stored = handlers.handle(m.Store(instance_id=1, token_ids=tokens, block_ids=pack_ids(range(8)),
                                     token=reply.token))  # fmt: skip
    assert isinstance(stored, m.StoreResult) and stored.stored_tokens == 32


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"fmt": "NO_SUCH_FORMAT"}, "unknown KV format"),
        ({"nesting": "nested", "group_sizes": [5]}, "do not add up"),
        ({"nesting": "tensor"}, "exactly one tensor"),
        ({"tensors": []}, "at least one KV tensor"),
    ],
)
def test_bad_registrations_are_layout_errors(handlers: Handlers, changes: dict[str, object],
                                            needle: str) -> None:  # fmt: skip
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=8,
                                  block_size=4, head_size=8))  # fmt: skip
    fields = {"instance_id": 1, "model_name": "m", **changes}
    reply = handlers.handle(_register(handlers, kv, **fields))
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LAYOUT and needle in reply.message
    assert handlers.registry.ids() == []


def test_requests_for_unknown_instances_are_typed_errors(handlers: Handlers) -> None:
    for req in (
        m.Unregister(instance_id=5),
        m.Lookup(instance_id=5, token_ids=pack_ids([1])),
        m.Retrieve(instance_id=5, token_ids=pack_ids([1]), block_ids=pack_ids([0])),
        m.ReportBlockAllocations(instance_id=5, records=[]),
        m.EndSession(instance_id=5, request_id="r"),
    ):
        reply = handlers.handle(req)
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.UNKNOWN_INSTANCE, req


def test_lifecycle_register_report_reap(handlers: Handlers) -> None:
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=8,
                                  block_size=4, head_size=8))  # fmt: skip
    nonce = b"n" * 16
    first = handlers.handle(_register(handlers, kv, instance_id=3, model_name="m", client_nonce=nonce))
    assert isinstance(first, m.Registered)
    loopback = Principal("loopback", shared=True)
    generation = handlers.registry.begin(3, loopback, first.token)  # a request of the first one, running
    assert generation
    again = handlers.handle(_register(handlers, kv, instance_id=3, model_name="m", client_nonce=nonce))
    assert isinstance(again, m.Registered)  # the same client again: replaced, not refused
    assert again.token != first.token
    record = handlers.registry.find(3)
    assert record is not None and record.in_flight == 1  # still counted: the reaper waits for it
    handlers.registry.end(3, generation)
    other = handlers.handle(_register(handlers, kv, instance_id=3, model_name="m"))
    assert isinstance(other, m.Error) and other.code is m.ErrorCode.ACCESS_DENIED  # not the same client
    pong = handlers.handle(m.Ping(instance_id=3, token=again.token))
    assert isinstance(pong, m.Pong) and pong.registered and pong.fd_socket
    report = m.ReportBlockAllocations(instance_id=3, records=[BlockAllocationRecord("r", [1], [9] * 4)])
    # Registered over the default (shared, loopback) principal: every request needs the token.
    refused = handlers.handle(report)
    assert isinstance(refused, m.Error) and refused.code is m.ErrorCode.ACCESS_DENIED
    report = msgspec.structs.replace(report, token=again.token)
    assert isinstance(handlers.handle(report), m.Done)
    assert isinstance(handlers.handle(m.EndSession(instance_id=3, request_id="r", token=again.token)), m.Done)
    assert handlers.handle(m.Status()).instances == []  # type: ignore[union-attr]
    status = handlers.handle(m.Status(), Principal("uid:0", operator=True))
    assert isinstance(status, m.StatusResult) and status.instances == [3]
    assert status.engine["instances"][0]["instance_id"] == 3
    (instance,) = handlers.registry.pop_expired(0.0, now=1e12)
    handlers.reap(instance)
    with pytest.raises(UnknownInstanceError):
        handlers.engine.lookup(3, [1, 2])
    assert handlers.handle(m.Ping(instance_id=3)).registered is False  # type: ignore[union-attr]
