"""The tests' daemon zygote answers like ``subprocess.Popen`` for what ``DaemonProcess`` uses."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from kvcache.client import KVCacheClient
from kvcache.server.launch import DaemonProcess, DaemonStartError
from kvcache.testing.daemon_zygote import Zygote

ARGS = ["--chunk-size", "16", "--l1-size-gb", "0.05"]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote() as z:
        yield z


def test_a_forked_daemon_serves_and_reports_its_exit_status(zygote: Zygote) -> None:
    d = DaemonProcess(ARGS, spawn=zygote.spawn)
    with KVCacheClient(d.ipc_endpoint, 0, "m", timeout_s=10) as client:
        assert client.ping() is False  # answered: the daemon serves (instance 0 not registered)
    assert d.proc.poll() is None
    assert d.stop() == 0, d.log
    assert "kvcache daemon stopped" in d.log
    d.remove_runtime_dir()


def test_a_killed_daemon_and_a_refused_start_report_like_popen(zygote: Zygote) -> None:
    d = DaemonProcess(ARGS, spawn=zygote.spawn)
    d.kill()
    assert d.proc.returncode == -signal.SIGKILL
    d.remove_runtime_dir()
    with pytest.raises(DaemonStartError, match="exited with status 2"):
        DaemonProcess([*ARGS, "--no-such-flag"], spawn=zygote.spawn)


def test_the_descriptor_limit_reaches_the_child(zygote: Zygote) -> None:
    d = DaemonProcess(ARGS, spawn=zygote.spawn, nofile=(512, 512))
    with open(f"/proc/{d.pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    assert line.split()[3:5] == ["512", "512"]
    d.kill()
    d.remove_runtime_dir()


def test_no_daemon_outlives_its_zygote() -> None:
    with Zygote() as z:
        d = DaemonProcess(ARGS, spawn=z.spawn)
    assert d.proc.wait(30) == -signal.SIGKILL  # the zygote's exit killed it and said so
    with pytest.raises(ProcessLookupError):
        os.kill(d.pid, 0)
    d.remove_runtime_dir()
