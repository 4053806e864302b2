"""Sharing tensors (``transport.tensors``, ``memfd``, ``cuda_ipc``): the daemon's view aliases
the engine's bytes exactly, and a descriptor that claims more than it was given is refused."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys

import pytest
import torch

from kvcache.errors import CudaUnavailableError, LayoutError
from kvcache.protocol.messages import CudaIpcTensor, FdTensor
from kvcache.transport import memfd, tensors
from kvcache.transport.fdproto import ReceivedFds


def _received(shared: list[torch.Tensor]) -> tuple[list[FdTensor], ReceivedFds]:
    """What the daemon holds after a hand-over, without the socket: duplicated memfds."""
    descs, fds = memfd.export_cpu_tensors(shared)
    dups = [os.dup(fd) for fd in fds]
    return descs, ReceivedFds(dups, [os.fstat(fd).st_size for fd in dups], os.getuid(), os.getpid())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_import_aliases_the_exported_view(dtype: torch.dtype) -> None:
    base = memfd.empty_shared((3, 2, 8, 4), dtype)
    base.copy_(torch.randint(0, 100, base.shape).to(dtype))
    view = base[1, :, 2:6]  # non-contiguous, non-zero offset
    (desc,), received = _received([view])
    assert desc.offset == (1 * 64 + 2 * 4) * base.element_size()
    assert desc.stride == list(view.stride()) and desc.fd_index == 0
    mapped = tensors.import_tensor(desc, received).tensor
    received.close()  # the mapping outlives the descriptor
    assert torch.equal(mapped, view)
    mapped.fill_(7)  # writes through to the engine's tensor (retrieve depends on it)
    assert bool((base[1, :, 2:6] == 7).all()) and not bool((base[0] == 7).all())


def test_tensors_sharing_a_memfd_share_one_descriptor() -> None:
    a, b = memfd.empty_shared((2, 8), torch.float16), memfd.empty_shared((4,), torch.float32)
    descs, fds = memfd.export_cpu_tensors([a[0], b, a[1]])
    assert [d.fd_index for d in descs] == [0, 1, 0] and len(fds) == 2


def test_memory_is_sealed_and_leaves_nothing_in_dev_shm() -> None:
    t = memfd.empty_shared((1024,), torch.float32)
    _, (fd,) = memfd.export_cpu_tensors([t])
    with pytest.raises(PermissionError):  # F_SEAL_SHRINK: no truncation, no SIGBUS later
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):  # F_SEAL_GROW
        os.ftruncate(fd, 1 << 20)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    # Anonymous: no name in /dev/shm is this memory (compared by inode, not by the listing as a
    # whole: other processes, the suite's other workers too, use /dev/shm meanwhile).
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    inode = os.fstat(fd).st_ino
    assert all(e.inode() != inode for e in os.scandir("/dev/shm"))


def test_memory_goes_when_the_last_view_dies() -> None:
    t = memfd.empty_shared((16,), torch.float32)
    _, (fd,) = memfd.export_cpu_tensors([t])
    link = os.readlink(f"/proc/self/fd/{fd}")
    del t
    gc.collect()
    assert link not in {os.readlink(f"/proc/self/fd/{e}") for e in os.listdir("/proc/self/fd")
                        if os.path.exists(f"/proc/self/fd/{e}")}  # fmt: skip


def test_plain_cpu_tensor_is_refused_with_a_hint() -> None:
    with pytest.raises(LayoutError, match="empty_shared"):
        tensors.export_tensors([torch.zeros(8)])


def _desc(**kw: object) -> FdTensor:
    base = {"fd_index": 0, "offset": 0, "shape": [4], "stride": [1], "dtype": "float32"}
    return FdTensor(**{**base, **kw})  # type: ignore[arg-type]


def test_import_refuses_what_the_memfd_does_not_hold() -> None:
    _, received = _received([memfd.empty_shared((4,), torch.float32)])
    with pytest.raises(LayoutError, match="needs bytes"):
        tensors.import_tensor(_desc(shape=[5]), received)
    with pytest.raises(LayoutError, match="needs bytes"):
        tensors.import_tensor(_desc(shape=[2, 2], stride=[3, 1]), received)
    with pytest.raises(LayoutError, match="aligned"):
        tensors.import_tensor(_desc(offset=2, shape=[1]), received)
    with pytest.raises(LayoutError, match="unknown dtype"):
        tensors.import_tensor(_desc(dtype="object"), received)
    with pytest.raises(LayoutError, match="not handed over"):
        tensors.import_tensor(_desc(fd_index=1), received)
    with pytest.raises(LayoutError, match="not handed over"):
        tensors.import_tensor(_desc(), None)
    received.close()


def test_write_sealed_memory_is_a_layout_error_not_a_crash() -> None:
    fd = os.memfd_create("kvcache-ro", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 64)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    received = ReceivedFds([fd], [64], os.getuid(), os.getpid())
    with pytest.raises(LayoutError, match="read-write"):
        tensors.import_tensor(_desc(), received)
    received.close()


def test_a_read_only_descriptor_is_a_layout_error_not_a_crash() -> None:
    t = memfd.empty_shared((16,), torch.float32)
    _, (fd,) = memfd.export_cpu_tensors([t])
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # the same sealed memfd, opened read-only
    received = ReceivedFds([ro], [os.fstat(ro).st_size], os.getuid(), os.getpid())
    with pytest.raises(LayoutError, match="read-write"):
        tensors.import_tensor(_desc(), received)
    received.close()


def test_a_view_deep_inside_a_large_memfd_maps_only_its_own_pages() -> None:
    base = memfd.empty_shared((64, 4096), torch.float16)  # 512 KiB
    # Values in [-2, 2]: none can equal the 3 written below (randn hit an exact 3.0 in
    # about one run in thirty and failed the check on row 39).
    base.copy_(torch.randn(base.shape).clamp(-2, 2).to(torch.float16))
    view = base[40:43, 100:4000]
    (desc,), received = _received([view])
    assert desc.offset > 16 * 4096
    mapped = tensors.import_tensor(desc, received).tensor
    received.close()
    assert torch.equal(mapped, view)
    mapped.fill_(3)
    assert bool((base[40:43, 100:4000] == 3).all()) and not bool((base[39] == 3).any())
    address = mapped.data_ptr()
    lo, hi = next((lo, hi) for lo, hi, _, _ in memfd._memfd_mappings() if lo <= address < hi)
    assert hi - lo < base.nbytes // 8  # the daemon does not map the whole memfd per tensor


def test_cuda_descriptor_without_a_gpu_is_a_typed_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    desc = CudaIpcTensor(
        device_uuid="GPU-x", ipc_handle=b"h", storage_size_bytes=4, storage_offset_bytes=0,
        event_handle=b"", event_sync_required=False,
        storage_offset=0, shape=[1], stride=[1], dtype="float32",
    )  # fmt: skip
    with pytest.raises(CudaUnavailableError):
        tensors.import_tensor(desc)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_round_trip_in_another_process() -> None:
    t = torch.arange(64, dtype=torch.float16, device="cuda").view(4, 16)[1:3]
    (desc,), _ = tensors.export_tensors([t])
    assert isinstance(desc, CudaIpcTensor)
    from kvcache.protocol.codec import encode_request
    from kvcache.protocol.messages import Register

    frame = encode_request(1, Register(instance_id=0, model_name="m", tensors=[desc]))
    code = (
        "import sys, torch\n"
        "from kvcache.protocol.codec import decode_request\n"
        "from kvcache.transport import tensors\n"
        "desc = decode_request(sys.stdin.buffer.read()).body.tensors[0]\n"
        "t = tensors.import_tensor(desc).tensor\n"
        "print(t.float().sum().item(), t.device.type)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=frame, capture_output=True, check=True)
    total, device = out.stdout.decode().split()
    assert float(total) == float(t.float().sum().item()) and device == "cuda"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_descriptors_claiming_more_than_the_allocation_are_refused() -> None:
    """A client may claim any storage size and offset; the daemon checks them against the
    device allocation the handle maps, and never opens a reference-counter file it names."""
    import msgspec

    from kvcache.protocol.codec import encode_request
    from kvcache.protocol.messages import Register

    t = torch.arange(64, dtype=torch.float16, device="cuda")
    (desc,), _ = tensors.export_tensors([t])
    assert isinstance(desc, CudaIpcTensor)
    hostile = [
        msgspec.structs.replace(desc, storage_size_bytes=desc.storage_size_bytes + (1 << 30)),
        msgspec.structs.replace(desc, storage_offset_bytes=desc.storage_offset_bytes + (1 << 34)),
        msgspec.structs.replace(desc, shape=[1 << 20], stride=[1]),
    ]
    code = (
        "import sys, torch\n"
        "from kvcache.errors import LayoutError\n"
        "from kvcache.protocol.codec import decode_request\n"
        "from kvcache.transport import tensors\n"
        "desc = decode_request(sys.stdin.buffer.read()).body.tensors[0]\n"
        "try:\n"
        "    tensors.import_tensor(desc)\n"
        "except LayoutError as exc:\n"
        "    print('refused', exc)\n"
    )
    for bad in hostile:
        frame = encode_request(1, Register(instance_id=0, model_name="m", tensors=[bad]))
        out = subprocess.run([sys.executable, "-c", code], input=frame, capture_output=True, check=True)
        assert out.stdout.decode().startswith("refused"), (bad, out.stderr.decode())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_offset_aimed_at_another_mapping_is_refused() -> None:
    """torch places an imported storage at the handle's base plus ``storage_offset_bytes``,
    unchecked. An offset that lands inside another allocation the daemon has mapped (another
    engine's KV) must be refused: the allocation checked is the handle's own, not whichever
    one the offset reaches. Deterministic: the importer maps two allocations of one exporter,
    then one handle again with the offset that reaches the other's storage."""
    from kvcache.protocol.codec import encode_request
    from kvcache.protocol.messages import Register

    # Two large tensors: each its own device allocation, each its own IPC handle.
    gpu = [torch.full((8 << 20,), float(i), dtype=torch.float32, device="cuda") for i in (1, 2)]
    descs, _ = tensors.export_tensors(gpu)
    frame = encode_request(1, Register(instance_id=0, model_name="m", tensors=list(descs)))
    code = (
        "import sys, msgspec\n"
        "from kvcache.errors import LayoutError\n"
        "from kvcache.protocol.codec import decode_request\n"
        "from kvcache.transport import tensors\n"
        "descs = decode_request(sys.stdin.buffer.read()).body.tensors\n"
        "mapped = [(tensors.import_tensor(d).tensor, d) for d in descs]\n"
        "(low, low_d), (high, high_d) = sorted(mapped, key=lambda p: p[0].data_ptr())\n"
        "low_base = low.untyped_storage().data_ptr() - low_d.storage_offset_bytes\n"
        "forged = msgspec.structs.replace(\n"
        "    low_d, storage_offset_bytes=high.untyped_storage().data_ptr() - low_base,\n"
        "    storage_size_bytes=high_d.storage_size_bytes)\n"
        "try:\n"
        "    t = tensors.import_tensor(forged).tensor\n"
        "    print('accepted', t[0].item())\n"
        "except LayoutError as exc:\n"
        "    print('refused', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=frame, capture_output=True, check=True)
    assert out.stdout.decode().startswith("refused"), out.stdout.decode() + out.stderr.decode()
