"""Engine memory that cannot hurt the daemon: sealed memfds, no paths, nothing to clean up.

Observed before, each against a real daemon: (3) an engine truncating its shared-memory file
after registering killed the daemon with SIGBUS on the next copy; (4) registration opened any
file under /dev/shm read-write; (5) orphan cleanup trusted the client's pid and deleted a live
engine's files. Each test now plays that engine and checks the daemon keeps serving others.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import LayoutError
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.transport import memfd
from kvcache.transport.fdpass import send_fds

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))


def _cache(seed: int = 0) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def _open_files(pid: int) -> set[str]:
    out = set()
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{entry}"))
        except OSError:  # closed meanwhile
            continue
    return out


def _fd_socket(d: DaemonProcess) -> str:
    pong = raw_call(d.endpoint, m.Ping())
    assert isinstance(pong, m.Pong) and pong.fd_socket
    return pong.fd_socket


TRUNCATING_ENGINE = r"""
import os, sys, torch
from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches
from kvcache.transport import memfd
kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                              block_size=4, num_heads=2, head_size=8, dtype=torch.float16))
c = KVCacheClient(sys.argv[1], 99, "victim-model", timeout_s=5)
c.register_kv_caches(kv)
_, fds = memfd.export_cpu_tensors(kv)
refused = 0
for fd in fds:
    for size in (0, 2 * os.fstat(fd).st_size):   # shrink (SIGBUS before), grow
        try:
            os.ftruncate(fd, size)    # what crashed the daemon before (SIGBUS on its next copy)
        except PermissionError:
            refused += 1
print("refused", refused, "of", 2 * len(fds), flush=True)
try:
    c.store(list(range(64)), list(range(16)))   # the daemon copies from the (intact) memory
except Exception as exc:
    print("store failed:", type(exc).__name__, exc, flush=True)
    raise
print("stored", flush=True)
os._exit(0)                                 # dies without unregistering
"""


def test_an_engine_cannot_truncate_its_memory_under_the_daemon(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    out = subprocess.run([sys.executable, "-c", TRUNCATING_ENGINE, d.endpoint], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.split("\n")
    n = int(lines[0].split()[-1])
    assert lines[0] == f"refused {n} of {n}" and lines[1] == "stored"
    kv = _cache(1)
    want = clone_caches(kv)
    with KVCacheClient(d.endpoint, 1, "other-model", timeout_s=5) as c:  # the daemon lives on
        c.register_kv_caches(kv)
        c.store(TOKENS, BLOCKS)
        for t in kv:
            t.zero_()
        assert c.retrieve(TOKENS, BLOCKS) == 64 and caches_equal(kv, want)
    assert d.proc.poll() is None


def test_the_daemon_never_opens_a_file_a_client_names(
    start_daemon: Callable[..., DaemonProcess], tmp_path: object
) -> None:
    d = start_daemon()
    sock = _fd_socket(d)
    secret = f"/dev/shm/kvcache-{os.getpid()}-secret"
    with open(secret, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        # A descriptor of a file (what a path used to name) is not a sealed memfd: refused.
        fd = os.open(secret, os.O_RDWR)
        with pytest.raises(LayoutError, match="sealed"):
            send_fds(sock, secrets.token_bytes(16), [fd], 5)
        os.close(fd)
        # No descriptor at all: the tensor names nothing the daemon could open.
        desc = m.FdTensor(fd_index=0, offset=0, shape=[2048], stride=[1], dtype="float16")
        reply = raw_call(d.endpoint, m.Register(instance_id=5, model_name="x", tensors=[desc]))
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.LAYOUT
        # A ticket nobody handed over is refused too.
        reply = raw_call(d.endpoint, m.Register(instance_id=5, model_name="x", tensors=[desc],
                                                fd_ticket=secrets.token_bytes(16)))  # fmt: skip
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.ACCESS_DENIED
        assert secret not in _open_files(d.pid)
    finally:
        os.unlink(secret)


def test_unregistering_never_deletes_anyone_elses_files(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    planted = f"/dev/shm/kvcache-{2**22 + 7}-live-engine"  # looks like an old engine file
    with open(planted, "wb") as f:
        f.write(b"x" * 64)
    try:
        kv = _cache(2)
        with KVCacheClient(d.endpoint, 3, "m", timeout_s=5) as c:
            c.register_kv_caches(kv)
        # The daemon was handed descriptors, never paths or pids: there is nothing to clean up.
        assert os.path.exists(planted)
    finally:
        os.unlink(planted)


def test_an_unsealed_memfd_is_refused_and_the_daemon_stays_up(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    fd = os.memfd_create("kvcache-unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    with pytest.raises(LayoutError, match="sealed"):
        send_fds(_fd_socket(d), secrets.token_bytes(16), [fd], 5)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    send_fds(_fd_socket(d), secrets.token_bytes(16), [fd], 5)  # sealed: accepted
    os.close(fd)
    with KVCacheClient(d.endpoint, 4, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache(3))
        assert c.ping()
    assert memfd.MEMFD_PREFIX == "kvcache-"


def test_a_skip_past_the_request_is_clamped(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    with KVCacheClient(d.endpoint, 6, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache(4))
        c.store(TOKENS, BLOCKS)
        assert c.retrieve(TOKENS, BLOCKS, skip_tokens=10**9) == 64  # not a billion
