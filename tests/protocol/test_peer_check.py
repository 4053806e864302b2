"""The client's watch of the daemon's process (``peer_check.DaemonUidCheck``) against real
processes: what it says exited must have exited, whatever pids the kernel hands out again."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvcache.protocol.peer_check import DaemonUidCheck

REPO = Path(__file__).resolve().parents[2]


def _namespaces() -> bool:
    """Whether this user may make a user and pid namespace (where pids can be reused at will)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urpf", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _namespaces(), reason="needs unprivileged user and pid namespaces (unshare -Urpf)")
def test_a_daemon_restarted_under_its_predecessors_pid_is_not_taken_for_exited() -> None:
    """A daemon killed, and the next one on its socket given the same pid (in a pid namespace
    of its own, so the test picks the pid): the client's check must watch the new process.
    It kept the exited one's pidfd under that pid, so when the live daemon dropped a
    connection (a frame over its cap here; its connection cap, say) the calls sent to it were
    failed at once as "exited", and the engine could reuse blocks the daemon still copied into."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = str(Path(__file__).with_name("reused_pid.py"))
    done = subprocess.run(["unshare", "-Urpf", sys.executable, script], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    if done.returncode == 77:
        pytest.skip("the kernel did not hand the pid out again")
    assert done.returncode == 0, done.stderr


def test_a_daemon_whose_pidfd_cannot_be_opened_is_unknown_not_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next daemon approved while no pidfd can be opened (the client out of descriptors):
    calls sent to it must not be taken for calls to the one before, which exited, or a
    connection the live daemon drops fails them at once."""
    ctx: zmq.Context[Any] = zmq.Context()
    check = DaemonUidCheck(ctx, os.getuid())
    before = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    now = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        check._watch(before.pid)
        before.kill()
        before.wait()
        monkeypatch.setattr(os, "pidfd_open", _no_descriptor)
        check._watch(now.pid)
        assert not check.exited(check.pid)
        assert check.pid is None
    finally:
        now.kill()
        now.wait()
        check.close()
        ctx.term()


def _no_descriptor(pid: int, flags: int = 0) -> int:
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
