"""A registration descriptor whose numbers do not fit int64 must be a typed LAYOUT refusal that
leaks nothing of the daemon's process.

Found by a hostile-client pass: a stride (or a size) past int64 on a dimension that the span
check ignores (a size-1 dimension contributes nothing to the span; a stride of 0 makes any size
span one element) passes ``import_fd_tensor``'s bounds check and reaches ``Tensor.as_strided``,
which raises a ``TypeError`` carrying torch's C++ backtrace. The daemon answers
``BAD_REQUEST`` (a generic code the client cannot map to ``LayoutError``) with that backtrace,
frame addresses inside the daemon's libc10/libtorch_python/libc mappings included, as the
message: an ASLR leak to any client, and the protocol's "a message for people, never a
traceback" broken.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def _stride_past_int64(desc: m.FdTensor) -> m.FdTensor:
    # dimension 0 of size 1: (1 - 1) * stride adds nothing to the span the memfd must hold
    return m.FdTensor(fd_index=desc.fd_index, offset=desc.offset, shape=[1, *desc.shape[1:]],
                      stride=[1 << 63, *desc.stride[1:]], dtype=desc.dtype)  # fmt: skip


def _size_past_int64(desc: m.FdTensor) -> m.FdTensor:
    # stride 0: any size spans one element
    return m.FdTensor(fd_index=desc.fd_index, offset=desc.offset, shape=[1 << 63, *desc.shape[1:]],
                      stride=[0, *desc.stride[1:]], dtype=desc.dtype)  # fmt: skip


HOSTILE = {"stride_past_int64": _stride_past_int64, "size_past_int64": _size_past_int64}


@pytest.mark.parametrize("make", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_descriptor_number_past_int64_is_a_layout_refusal_without_a_native_backtrace(
    start_daemon: Callable[..., DaemonProcess], make: Callable[[m.FdTensor], m.FdTensor]
) -> None:
    d = start_daemon()
    pong = raw_call(d.endpoint, m.Ping())
    assert isinstance(pong, m.Pong) and pong.fd_socket
    attacker_kv = _cache(seed=1)  # kept alive: its mappings hold the memfds handed over
    descs, fds = memfd.export_cpu_tensors(attacker_kv)
    ticket = secrets.token_bytes(16)
    send_fds(pong.fd_socket, ticket, fds, 5.0)
    hostile = m.Register(instance_id=5, model_name="m", tensors=[make(x) for x in descs],
                         fd_ticket=ticket)  # fmt: skip
    reply = raw_call(d.endpoint, hostile)
    assert isinstance(reply, m.Error), reply
    # Nothing of the daemon's process leaks: no native frames, no addresses of its mappings.
    assert "frame #" not in reply.message, reply.message
    assert not re.search(r"0x7f[0-9a-f]{8,}", reply.message), reply.message
    # A descriptor that does not describe a tensor is what LAYOUT names (LayoutError for the
    # client), as every other bad descriptor is.
    assert reply.code is m.ErrorCode.LAYOUT, reply
    # The daemon keeps serving.
    assert d.proc.poll() is None
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache(seed=2))
        assert c.store(TOKENS, BLOCKS).stored_tokens == 64
