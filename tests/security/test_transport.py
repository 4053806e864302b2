"""Who can connect: CURVE keys and tenants over TCP, peer uids over ipc://.

Real pyzmq CURVE between two processes (the daemon and this test), real Unix sockets, and a
peer that really runs as another user (``nobody``) when the suite runs as root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.config import EngineConfig
from kvcache.engine import CacheEngine
from kvcache.errors import AccessDeniedError
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import encode_request
from kvcache.protocol.errors import DaemonUnavailableError
from kvcache.server.daemon import Daemon, DaemonConfig
from kvcache.server.handlers import Handlers
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess, DaemonStartError
from kvcache.server.registry import InstanceRegistry
from kvcache.testing import make_kv_caches

TOKENS, BLOCKS = list(range(64)), list(range(16))
NOBODY = 65534


def _cache() -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=0)  # fmt: skip
    return to_shared(kv)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("daemon", "tenant-a", "mallory"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0
    public = (tmp_path / "tenant-a.key").read_text().split('public-key = "')[1].split('"')[0]
    (tmp_path / "clients.toml").write_text(
        f'[[client]]\nname = "tenant-a"\npublic_key = "{public}"\nmodels = ["model-a"]\ncache_salts = ["a"]\n'
    )
    return tmp_path


def _curve_client(d: DaemonProcess, keys: Path, who: str, model: str, instance: int) -> KVCacheClient:
    return KVCacheClient(d.endpoint, instance, model, timeout_s=3,
                         curve_server_key=str(keys / "daemon.key"),
                         curve_secret_key=str(keys / f"{who}.key_secret"))  # fmt: skip


def test_curve_daemon_serves_a_known_key_and_refuses_others(
    start_daemon: Callable[..., DaemonProcess], keys: Path
) -> None:
    d = start_daemon("--curve-secret-key", str(keys / "daemon.key_secret"),
                     "--clients", str(keys / "clients.toml"), tcp=True)  # fmt: skip
    with _curve_client(d, keys, "tenant-a", "model-a", 1) as a:
        a.register_kv_caches(_cache())
        assert a.store(TOKENS, BLOCKS, cache_salt="a").stored_tokens == 64
        assert a.lookup(TOKENS, cache_salt="a") == 64
        with pytest.raises(AccessDeniedError, match="cache salt"):
            a.lookup(TOKENS, cache_salt="b")  # another tenant's namespace
        with pytest.raises(AccessDeniedError, match="cache salt"):
            a.store(TOKENS, BLOCKS)  # the unsalted namespace is not in its list either
    with _curve_client(d, keys, "tenant-a", "model-b", 2) as wrong_model, \
            pytest.raises(AccessDeniedError, match="model"):  # fmt: skip
        wrong_model.register_kv_caches(_cache())
    with _curve_client(d, keys, "mallory", "model-a", 3) as mallory, \
            pytest.raises(AccessDeniedError, match="refused"):  # fmt: skip
        mallory.status()
    with (
        KVCacheClient(d.endpoint, 4, "model-a", timeout_s=2) as plain,
        pytest.raises((AccessDeniedError, DaemonUnavailableError)),
    ):  # no CURVE at all; fmt: skip
        plain.status()
    assert "refused a connection" in d.log


def test_listening_beyond_loopback_needs_curve(start_daemon: Callable[..., DaemonProcess]) -> None:
    with pytest.raises(DaemonStartError, match="CURVE"):
        start_daemon("--host", "0.0.0.0", "--allow-remote", tcp=True)
    with pytest.raises(DaemonStartError, match="--allow-remote"):
        start_daemon("--host", "0.0.0.0", tcp=True)
    with pytest.raises(DaemonStartError, match="add --tcp"):  # TCP flags without TCP: told, not ignored
        start_daemon("--host", "0.0.0.0", "--allow-remote")


@pytest.fixture
def ipc_daemon() -> Iterator[Daemon]:
    engine = CacheEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    # Under /tmp itself (not pytest's 0700 tmp_path) so that only the daemon's own directory
    # stands between another user and the socket.
    runtime = os.path.join(tempfile.mkdtemp(prefix="kvcache-test-"), "run")
    d = Daemon(DaemonConfig(listen_tcp=False, runtime_dir=runtime),
               Handlers(engine, InstanceRegistry(), 30.0))  # fmt: skip
    thread = threading.Thread(target=d.serve, name="ipc-daemon")
    thread.start()
    yield d
    d.request_stop()
    thread.join(30)
    engine.close()
    shutil.rmtree(os.path.dirname(runtime), ignore_errors=True)


def test_the_runtime_dir_and_sockets_are_private(ipc_daemon: Daemon) -> None:
    assert oct(os.stat(ipc_daemon.runtime_dir).st_mode & 0o777) == "0o700"
    for name in ("daemon.sock", "fds.sock"):
        assert os.stat(os.path.join(ipc_daemon.runtime_dir, name)).st_mode & 0o077 == 0
    with KVCacheClient(ipc_daemon.ipc_endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache())
        assert c.store(TOKENS, BLOCKS).stored_tokens == 64


def test_a_planted_runtime_dir_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    engine = CacheEngine(EngineConfig(chunk_size=16, l1_size_bytes=64 << 20))
    try:
        with pytest.raises(OSError, match="0700"):
            Daemon(DaemonConfig(listen_tcp=False, runtime_dir=str(planted)),
                   Handlers(engine, InstanceRegistry(), 30.0))  # fmt: skip
    finally:
        engine.close()


def _ping_as(uid: int, endpoint: str) -> int:
    """Fork a child that drops to ``uid`` and pings ``endpoint``: exit 0 = answered,
    3 = no answer within 2 s."""
    pid = os.fork()
    if pid == 0:  # child: no test machinery, only a fresh ZMQ context
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(encode_request(1, m.Ping()))
            code = 0 if sock.poll(2000) else 3
            sock.close()
            ctx.term()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as nobody")
def test_an_ipc_peer_of_another_uid_is_refused(ipc_daemon: Daemon) -> None:
    endpoint = ipc_daemon.ipc_endpoint
    assert endpoint is not None
    assert _ping_as(0, endpoint) == 0  # the daemon's own uid is served
    # The directory alone keeps nobody out ...
    assert _ping_as(NOBODY, endpoint) == 3
    # ... and were it (and the socket) opened by mistake, the uid check still refuses.
    os.chmod(os.path.dirname(ipc_daemon.runtime_dir), 0o755)
    os.chmod(ipc_daemon.runtime_dir, 0o755)
    os.chmod(endpoint.removeprefix("ipc://"), 0o777)
    refused = ipc_daemon._zap.refused
    assert _ping_as(NOBODY, endpoint) == 3
    assert ipc_daemon._zap.refused > refused
