"""Shared-memory export/import: the daemon's view aliases the engine's bytes exactly."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.protocol.messages import CudaIpcTensor, ShmTensor
from kvcache.server import ipc


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_import_aliases_the_exported_view(dtype: torch.dtype) -> None:
    base = ipc.empty_shared((3, 2, 8, 4), dtype)
    base.copy_(torch.randint(0, 100, base.shape).to(dtype))
    view = base[1, :, 2:6]  # non-contiguous, non-zero offset
    desc = ipc.export_tensor(view)
    assert isinstance(desc, ShmTensor)
    assert desc.offset == (1 * 64 + 2 * 4) * base.element_size()
    assert desc.stride == list(view.stride()) and desc.owner_pid == os.getpid()
    mapped = ipc.import_tensor(desc).tensor
    assert torch.equal(mapped, view)
    mapped.fill_(7)  # writes through to the engine's tensor (retrieve depends on it)
    assert bool((base[1, :, 2:6] == 7).all()) and not bool((base[0] == 7).all())


def test_segment_is_removed_when_the_last_view_dies() -> None:
    t = ipc.empty_shared((16,), torch.float32)
    path = ipc.export_cpu_tensor(t).path
    assert os.path.exists(path)
    del t
    gc.collect()
    assert not os.path.exists(path)


def test_plain_cpu_tensor_is_refused_with_a_hint() -> None:
    with pytest.raises(LayoutError, match="empty_shared"):
        ipc.export_tensor(torch.zeros(8))


def _desc(**kw: object) -> ShmTensor:
    base = {"path": "", "offset": 0, "shape": [4], "stride": [1], "dtype": "float32"}
    return ShmTensor(**{**base, **kw})  # type: ignore[arg-type]


def test_import_refuses_paths_outside_dev_shm() -> None:
    with pytest.raises(LayoutError, match="/dev/shm"):
        ipc.import_tensor(_desc(path="/etc/passwd"))
    with pytest.raises(LayoutError, match="/dev/shm"):
        ipc.import_tensor(_desc(path="/dev/shm/../../etc/passwd"))


def test_import_refuses_spans_past_the_end_of_the_file() -> None:
    t = ipc.empty_shared((4,), torch.float32)
    path = ipc.export_cpu_tensor(t).path
    with pytest.raises(LayoutError, match="needs bytes"):
        ipc.import_tensor(_desc(path=path, shape=[5]))
    with pytest.raises(LayoutError, match="needs bytes"):
        ipc.import_tensor(_desc(path=path, shape=[2, 2], stride=[3, 1]))
    with pytest.raises(LayoutError, match="aligned"):
        ipc.import_tensor(_desc(path=path, offset=2, shape=[1]))
    with pytest.raises(LayoutError, match="unknown dtype"):
        ipc.import_tensor(_desc(path=path, dtype="object"))
    with pytest.raises(LayoutError, match="cannot open"):
        ipc.import_tensor(_desc(path="/dev/shm/kvcache-does-not-exist"))


def test_orphaned_segment_of_a_dead_process_is_removed() -> None:
    code = (
        "import os, torch\n"
        "from kvcache.server import ipc\n"
        "t = ipc.empty_shared((8,), torch.float32)\n"
        "print(ipc.export_cpu_tensor(t).path, flush=True)\n"
        "os._exit(0)\n"  # no finalizers: the file stays behind, as after a SIGKILL
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path, pid = out.stdout.strip(), None
    pid = int(os.path.basename(path).split("-")[1])
    assert os.path.exists(path)
    assert not ipc.remove_orphaned_segment(path, os.getpid())  # a live owner keeps its file
    assert ipc.remove_orphaned_segment(path, pid)
    assert not os.path.exists(path)


def test_foreign_files_are_never_removed(tmp_path: object) -> None:
    assert not ipc.remove_orphaned_segment("/dev/shm/someone-else", 2**22 + 12345)
    assert not ipc.remove_orphaned_segment("/tmp/kvcache-1-abc", 2**22 + 12345)


def test_cuda_descriptor_without_a_gpu_is_a_typed_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    desc = CudaIpcTensor(
        device_uuid="GPU-x", ipc_handle=b"h", storage_size_bytes=4, storage_offset_bytes=0,
        ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"", event_sync_required=False,
        storage_offset=0, shape=[1], stride=[1], dtype="float32",
    )  # fmt: skip
    with pytest.raises(CudaUnavailableError):
        ipc.import_tensor(desc)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_round_trip_in_another_process() -> None:
    t = torch.arange(64, dtype=torch.float16, device="cuda").view(4, 16)[1:3]
    desc = ipc.export_tensor(t)
    assert isinstance(desc, CudaIpcTensor)
    from kvcache.protocol.codec import encode_request
    from kvcache.protocol.messages import Register

    frame = encode_request(1, Register(instance_id=0, model_name="m", tensors=[desc]))
    code = (
        "import sys, torch\n"
        "from kvcache.protocol.codec import decode_request\n"
        "from kvcache.server import ipc\n"
        "desc = decode_request(sys.stdin.buffer.read()).body.tensors[0]\n"
        "t = ipc.import_tensor(desc).tensor\n"
        "print(t.float().sum().item(), t.device.type)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=frame, capture_output=True, check=True)
    total, device = out.stdout.decode().split()
    assert float(total) == float(t.float().sum().item()) and device == "cuda"
