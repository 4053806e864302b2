"""Issue 20, finding 5: a planted runtime directory or fd socket catches no engine's memory.

Before the fix another local user could create ``/tmp/kvcache-UID`` before the daemon's
first start and run a fake daemon there: the client handed it the engine's KV memfds
read-write (and its prompts' token ids), and it followed any fd-socket path a reply named.
Each test below plays that user with ``impostor`` (a fake daemon that reports what it
caught) and checks that it caught nothing; the last ones check that real daemons still
serve engines over both endpoints.

"Another user" is played by ownership (``os.chown`` to ``nobody``) where the check is about
the directory, and by an impostor process that drops to ``nobody``'s uid where the check is
the peer's uid (``SO_PEERCRED``); those need root and are skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import AccessDeniedError
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches

NOBODY = 65534
TOKENS, BLOCKS = list(range(64)), list(range(16))
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with chown/setuid")


def _cache(seed: int = 0) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


class Impostor:
    """A running ``tests.security.impostor``: ``endpoint`` it listens on, ``caught`` lines."""

    def __init__(self, proc: subprocess.Popen[str], endpoint: str) -> None:
        self.proc, self.endpoint = proc, endpoint
        self.caught: list[str] = []


@contextmanager
def impostor(directory: Path, *flags: str, uid: int | None = None) -> Iterator[Impostor]:
    """Start a fake daemon in ``directory``; on exit it stops and ``caught`` holds its catch."""
    cmd = [sys.executable, "-m", "tests.security.impostor", str(directory), *flags]
    if uid is not None:
        cmd += ["--uid", str(uid)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    first = proc.stdout.readline().split()
    assert first[:1] == ["ready"], f"the impostor did not start: {first}"
    fake = Impostor(proc, first[1])
    try:
        yield fake
    finally:
        proc.stdin.close()  # its signal to stop
        fake.caught = [line.strip() for line in proc.stdout]
        proc.wait(timeout=30)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A fresh directory under /tmp that other users may traverse (0711; pytest's own
    ``tmp_path`` is 0700 root), so that an impostor running as ``nobody`` can listen below it."""
    base = Path(tempfile.mkdtemp(prefix="kvcache-planted-", dir="/tmp"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _register(endpoint: str | None) -> None:
    """What an engine does first: connect and register its (CPU, memfd) KV cache."""
    client = KVCacheClient(endpoint, model_name="victim", timeout_s=5)
    try:
        client.register_kv_caches(_cache())
    finally:
        client.close(unregister=False)


def _planted(base: Path, how: str) -> Path:
    """A runtime directory another user could have planted, and where the impostor listens."""
    real = base / "kvcache-real"
    real.mkdir(mode=0o700)
    if how == "symlink":  # a link (owned by whoever made it) to a directory of ours
        link = base / "kvcache-link"
        link.symlink_to(real)
        return link
    if how == "foreign-owner":
        os.chown(real, NOBODY, NOBODY)
    elif how == "world-writable":
        os.chmod(real, 0o777)  # ours, but anyone could have put the socket there
    return real


@needs_root
@pytest.mark.parametrize("how", ["foreign-owner", "world-writable", "symlink"])
def test_the_client_refuses_a_planted_runtime_dir(
    open_tmp: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _planted(open_tmp, how)
    monkeypatch.setenv("KVCACHE_RUNTIME_DIR", str(runtime))  # the default endpoint is there
    with (
        impostor(runtime.resolve(), "--zmq", "--fds") as fake,
        pytest.raises(AccessDeniedError, match=re.escape(str(runtime))) as refused,
    ):
        _register(None)
    assert fake.caught == [], "the fake daemon got a request or the engine's memory"
    assert any(hint in str(refused.value) for hint in ("chown", "chmod", "symlink"))


@needs_root
def test_the_client_refuses_a_daemon_of_another_uid(open_tmp: Path) -> None:
    """The directory looks right (ours, 0700), but the process behind the socket is not ours:
    ``SO_PEERCRED`` on the ZMQ connection says so before any request leaves."""
    runtime = open_tmp / "kvcache-0"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, NOBODY, NOBODY)  # so that nobody can listen in it ...
    with impostor(runtime, "--zmq", "--fds", uid=NOBODY) as fake:
        os.chown(runtime, 0, 0)  # ... and now it is root's again, 0700
        with pytest.raises(AccessDeniedError, match=f"listening there runs as uid {NOBODY}"):
            _register(fake.endpoint)
    assert fake.caught == []


@needs_root
def test_a_fake_daemon_taking_over_after_a_restart_gets_nothing(
    start_daemon: Callable[..., DaemonProcess], open_tmp: Path
) -> None:
    """The engine's daemon stops and a process of another uid takes its sockets over (the
    directory swapped in and out under it): ZMQ reconnects on its own, and the peer check
    refuses that connection too. The heartbeat thread lives on, so asynchronous calls fail
    with the refusal instead of hanging."""
    runtime = open_tmp / "kvcache-run"
    runtime.mkdir(mode=0o700)
    d = start_daemon(runtime_dir=str(runtime))
    client = KVCacheClient(d.ipc_endpoint, 1, "victim", timeout_s=5)
    try:
        client.register_kv_caches(_cache())
        assert d.stop() == 0
        os.chown(runtime, NOBODY, NOBODY)
        with impostor(runtime, "--zmq", "--fds", uid=NOBODY) as fake:
            os.chown(runtime, 0, 0)
            with pytest.raises(AccessDeniedError, match=f"runs as uid {NOBODY}"):
                client.lookup(TOKENS)
            future = client.store_async(TOKENS, BLOCKS)
            with pytest.raises(AccessDeniedError, match=f"runs as uid {NOBODY}"):
                future.result(timeout=60)  # a guard against a hang, not a timing assert
    finally:
        client.close(unregister=False)
    assert fake.caught == []


@needs_root
@pytest.mark.parametrize("how", ["foreign-dir", "foreign-listener"])
def test_memfds_go_only_to_a_verified_fd_socket(open_tmp: Path, how: str) -> None:
    """A loopback TCP endpoint (no peer credentials there) answered by a fake daemon whose
    ``Pong`` names an fd socket: in a directory of another user, or in a directory of ours
    but served by another uid. Neither gets a descriptor."""
    fds_dir = open_tmp / "fds"
    fds_dir.mkdir(mode=0o700)
    os.chown(fds_dir, NOBODY, NOBODY)
    uid = NOBODY if how == "foreign-listener" else None
    with impostor(fds_dir, "--tcp", "--fds", uid=uid) as fake:
        if how == "foreign-listener":
            os.chown(fds_dir, 0, 0)
        expected = "runs as uid" if how == "foreign-listener" else "is owned by uid"
        with pytest.raises(AccessDeniedError, match=rf"fds\.sock.*{expected} {NOBODY}"):
            _register(fake.endpoint)
    assert not [line for line in fake.caught if line.startswith("fds")], fake.caught


def test_a_client_expecting_another_daemon_uid_refuses_this_one(
    start_daemon: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVCACHE_DAEMON_UID`` names the daemon's user: a real daemon of another one is refused."""
    d = start_daemon()
    monkeypatch.setenv("KVCACHE_DAEMON_UID", str(os.getuid() + 1))
    with pytest.raises(AccessDeniedError, match=f"uid {os.getuid() + 1}"):
        _register(d.ipc_endpoint)
    monkeypatch.setenv("KVCACHE_DAEMON_UID", "not-a-uid")
    with pytest.raises(ValueError, match="KVCACHE_DAEMON_UID"):
        _register(d.ipc_endpoint)


@pytest.mark.parametrize("endpoint", ["ipc", "tcp"])
def test_engines_of_real_daemons_are_still_served(
    start_daemon: Callable[..., DaemonProcess], endpoint: str
) -> None:
    d = start_daemon()
    kv = _cache(3)
    want = clone_caches(kv)
    with KVCacheClient(d.ipc_endpoint if endpoint == "ipc" else d.endpoint, 1, "tenant",
                       timeout_s=5, daemon_uid=os.getuid()) as c:  # fmt: skip
        c.register_kv_caches(kv)
        assert c.store(TOKENS, BLOCKS).stored_tokens == 64
        for t in kv:
            t.zero_()
        assert c.retrieve(TOKENS, BLOCKS) == 64 and caches_equal(kv, want)
