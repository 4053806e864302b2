"""Bounds: one client cannot make the daemon hold unbounded descriptors, ids or instances.

Observed before: a registration with thousands of tensor descriptors exhausted the daemon's
file descriptors; block reports with ids far beyond the cache grew its memory without bound.
Each limit now answers a typed error and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import BlockIdError, LimitExceededError
from kvcache.layouts import KVFormat
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

from .conftest import raw_call


def _cache(blocks: int = 16) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=blocks,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=0)  # fmt: skip
    return to_shared(kv)


def _open_fds(pid: int) -> int:
    """Descriptors of ``pid`` other than sockets and ZMQ's eventfds: files and memfds."""
    count = 0
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        count += not target.startswith(("socket:", "anon_inode:", "pipe:"))
    return count


def test_thousands_of_descriptors_are_refused_before_anything_is_opened(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    fds_before = _open_fds(d.pid)
    desc = m.FdTensor(fd_index=0, offset=0, shape=[2, 4, 4, 2, 8], stride=[256, 64, 16, 8, 1],
                      dtype="float16")  # fmt: skip
    reply = raw_call(d.endpoint, m.Register(instance_id=1, model_name="x", tensors=[desc] * 5000))
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LIMIT, reply
    assert "--max-tensors" in reply.message
    huge = m.FdTensor(fd_index=0, offset=0, shape=[1 << 40], stride=[1], dtype="float32")
    reply = raw_call(d.endpoint, m.Register(instance_id=1, model_name="x", tensors=[huge]))
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LIMIT, reply
    assert _open_fds(d.pid) == fds_before
    with KVCacheClient(d.endpoint, 2, "m", timeout_s=5) as ok:  # others are still served
        ok.register_kv_caches(_cache())
        assert ok.lookup(list(range(64))) == 0


def test_ids_per_request_are_bounded(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon("--max-ids", "1000")
    with KVCacheClient(d.endpoint, 3, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache())
        with pytest.raises(LimitExceededError, match="--max-ids"):
            c.lookup(list(range(2000)))
        assert c.lookup(list(range(64))) == 0


def test_registered_instances_are_bounded(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon("--max-instances", "2")
    clients = [KVCacheClient(d.endpoint, 10 + i, "m", timeout_s=5) for i in range(3)]
    try:
        clients[0].register_kv_caches(_cache())
        clients[1].register_kv_caches(_cache())
        with pytest.raises(LimitExceededError, match="--max-instances"):
            clients[2].register_kv_caches(_cache())
        clients[0].unregister()
        clients[2].register_kv_caches(_cache())  # room again
    finally:
        for c in clients:
            c.close()


def test_block_reports_beyond_the_cache_are_refused(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    with KVCacheClient(d.endpoint, 4, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache(blocks=16))
        with pytest.raises(BlockIdError):
            c.report_block_allocations([BlockAllocationRecord("r", list(range(10**6, 10**6 + 5000)), [])])
        with pytest.raises(BlockIdError):
            c.report_block_allocations([BlockAllocationRecord("r", [-1], [])])
        c.report_block_allocations([BlockAllocationRecord("r", [0, 15], [])])  # in range: fine
        reply = raw_call(
            d.endpoint,
            m.ReportBlockAllocations(instance_id=4, token=c.session.token,
                                     records=[BlockAllocationRecord("x", [2**40], [])]),
        )  # fmt: skip
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BLOCK_ID
        assert c.ping()
