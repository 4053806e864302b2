"""CUDA failures become kvcache errors at one edge (``validate.cuda_error``), checked on a CPU.

Synthetic exceptions stand for what torch, the driver and the native module raise; the
edges (the daemon's IPC, the context's allocations, the CUDA handler, a store naming a CUDA
event) are called for real on this machine, where each must fail typed, never with a bare
RuntimeError or AssertionError.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache import _native
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.errors import CudaError, CudaUnavailableError, KvcacheError, LayoutError
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.handlers import Handlers
from kvcache.server.registry import InstanceRegistry, RegistrationRecord
from kvcache.transfer.cuda import CudaTransferHandler
from kvcache.transfer.validate import cuda_error, cuda_errors
from kvcache.transport import cuda_events, cuda_ipc
from tests.transfer.helpers import make_context, page_table

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a machine without a GPU fails")


@pytest.mark.parametrize(
    "raised, expected",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), CudaError),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), CudaError),
        (RuntimeError("CUDA error: invalid resource handle"), CudaError),
        (_native.CudaUnavailable("kvcache was built without CUDA"), CudaUnavailableError),
        (AssertionError("Torch not compiled with CUDA enabled"), CudaUnavailableError),
        (RuntimeError("Found no NVIDIA driver on your system."), CudaUnavailableError),
        (OSError("libcuda.so.1: cannot open shared object file"), CudaUnavailableError),
    ],
)
def test_failures_on_a_gpu_machine_are_typed(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, expected: type[KvcacheError]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = cuda_error(raised, "opening the thing")
    assert type(err) is expected
    assert isinstance(err, RuntimeError)  # callers catching RuntimeError keep working
    assert str(raised) in str(err) and str(err).startswith("opening the thing: ")


def test_without_cuda_every_failure_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = cuda_error(RuntimeError("Tried to instantiate dummy base class Event"), "x")
    assert type(err) is CudaUnavailableError


def test_kvcache_errors_pass_and_the_block_form_keeps_the_cause() -> None:
    kept = LayoutError("already typed")
    assert cuda_error(kept, "x") is kept
    with pytest.raises(LayoutError), cuda_errors("x"):
        raise kept
    original = RuntimeError("CUDA error: unspecified launch failure")
    with pytest.raises(CudaError) as caught, cuda_errors("launching"):
        raise original
    assert caught.value.__cause__ is original


@no_gpu
def test_the_ipc_edges_fail_typed_without_a_gpu() -> None:
    cuda = torch.device("cuda", 0)
    with pytest.raises(CudaUnavailableError):
        cuda_ipc.device_uuid(0)
    with pytest.raises(CudaUnavailableError):
        cuda_events.record_ipc_event(cuda)
    with pytest.raises(CudaUnavailableError):
        cuda_events.open_ipc_event(b"\0" * 64, cuda)
    with pytest.raises(CudaUnavailableError):
        cuda_events.wait_ipc_event(b"\0" * 64, cuda)


@no_gpu
def test_the_context_and_the_handler_fail_typed_without_a_gpu() -> None:
    ctx = make_context()
    with pytest.raises(CudaUnavailableError):
        ctx.allocate_chunks(1, device="cuda")
    assert len(ctx.allocate_chunks(2)) == 2  # CPU chunks are not CUDA's business
    with pytest.raises(CudaUnavailableError):
        CudaTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors)


@no_gpu
def test_a_store_naming_a_cuda_event_on_a_daemon_without_a_gpu_is_a_typed_reply() -> None:
    engine = CacheEngine(EngineConfig(chunk_size=64, l1_size_bytes=16 << 20))
    handlers = Handlers(engine, InstanceRegistry(), 30.0)
    try:
        engine.register(1, "m", make_context().tensors, block_size=16)
        on_gpu = dataclasses.replace(engine.geometry(1), device=torch.device("cuda:0"))
        handlers.registry.add(RegistrationRecord(1, "m", on_gpu, [], token=b"t" * 16))
        store = m.Store(instance_id=1, token=b"t" * 16, token_ids=pack_ids(range(64)),
                        block_ids=pack_ids(range(4)), cuda_event=b"\0" * 64)  # fmt: skip
        reply = handlers.submit(store).result(timeout=10)
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.CUDA_UNAVAILABLE, reply
    finally:
        engine.close()
