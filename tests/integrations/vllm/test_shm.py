"""vLLM's CPU KV buffer, allocated inside SharedKVAllocation, lands in a sealed memfd."""

from __future__ import annotations

import os

import torch

from kvcache.integrations.vllm.shm import SharedKVAllocation
from kvcache.transport.fdproto import ReceivedFds
from kvcache.transport.memfd import export_cpu_tensors
from kvcache.transport.tensors import import_tensor


def test_large_cpu_zeros_go_to_shared_memory_and_the_daemon_side_sees_writes() -> None:
    mode = SharedKVAllocation(min_bytes=1 << 16)
    with mode:
        buf = torch.zeros(1 << 20, dtype=torch.int8, device=torch.device("cpu"))
        small = torch.zeros(10)
    assert len(mode.buffers) == 1 and int(buf.abs().sum()) == 0
    layer = buf.view(torch.float32).view(2, 32, 2, 32, 64)[1]  # like vLLM's per-layer view
    (desc,), (fd,) = export_cpu_tensors([layer])
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvcache-")
    dup = os.dup(fd)
    received = ReceivedFds([dup], [os.fstat(dup).st_size], os.getuid(), os.getpid())
    peer = import_tensor(desc, received).tensor
    received.close()
    layer[3].fill_(1.5)
    assert torch.equal(peer, layer)
    assert small.shape == (10,)  # below min_bytes: an ordinary tensor
    assert export_cpu_tensor_raises(small)


def export_cpu_tensor_raises(t: torch.Tensor) -> bool:
    try:
        export_cpu_tensors([t])
    except Exception:
        return True
    return False


def test_other_calls_pass_through() -> None:
    with SharedKVAllocation():
        a = torch.ones(3)
        b = torch.zeros((2, 2), dtype=torch.float16)
    assert a.sum() == 3 and b.dtype == torch.float16
