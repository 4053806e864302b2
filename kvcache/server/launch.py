"""Start ``python -m kvcache.server`` as a child process and wait until it is ready.

Shared by the demo, the daemon benchmark and the tests, which all need a real daemon in its
own process and the endpoints from its start line, rather than each parsing logs its own way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Protocol

from kvcache.errors import DaemonStartError  # re-exported: tests and benches import it here

_READY = re.compile(
    r"kvcache daemon ready: zmq (?P<zmq>\S+), ipc (?P<ipc>\S+), fds \S+, metrics (?P<metrics>[^,]+),"
)


class DaemonHandle(Protocol):
    """What ``DaemonProcess`` needs of its child: a ``subprocess.Popen``, or a process started
    another way (``kvcache.testing.daemon_zygote``) that answers the same calls."""

    pid: int
    stderr: IO[str] | None
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class Spawn(Protocol):
    """Starts ``python -m kvcache.server <argv>`` with exactly ``env`` and the descriptor
    limit ``nofile``, its stderr a text pipe the caller reads."""

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], nofile: tuple[int, int] | None
    ) -> DaemonHandle: ...


def _limit_descriptors(nofile: tuple[int, int]) -> None:
    """In the child before exec: its descriptor (soft, hard) limit."""
    resource.setrlimit(resource.RLIMIT_NOFILE, nofile)


class DaemonProcess:
    """A daemon child process; its stderr is collected in ``lines`` (and echoed if asked).

    ``endpoint`` is the ZMQ address clients connect to: TCP with ``tcp=True`` (on ``port``,
    0 = a free one), else the Unix socket; ``ipc_endpoint`` the Unix socket one (or
    ``"off"``); ``metrics_url`` is the Prometheus URL, or ``"off"``. Without ``runtime_dir``
    the daemon gets a fresh private directory for its sockets (removed with the process
    object), so concurrent daemons never collide; pass the same ``runtime_dir`` to start a
    daemon again at the same ipc:// endpoint. ``nofile`` starts it under that (soft, hard)
    descriptor limit, as a host with a low ``ulimit -n`` would. ``spawn`` starts the process
    another way than exec (the tests' zygote, which skips the import of torch per daemon).
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int = 0,
        tcp: bool = False,
        prometheus_port: int | None = 0,
        ready_timeout_s: float = 60.0,
        echo: bool = False,
        env: dict[str, str] | None = None,
        runtime_dir: str | None = None,
        nofile: tuple[int, int] | None = None,
        spawn: Spawn | None = None,
    ) -> None:
        self._own_dir = runtime_dir is None
        self.runtime_dir = tempfile.mkdtemp(prefix="kvcache-") if runtime_dir is None else runtime_dir
        # The ready line is logged at INFO; its log is captured here, not shown unless ``echo``.
        argv = ["--runtime-dir", self.runtime_dir, *args, "--log-level", "INFO"]
        if tcp:
            argv += ["--tcp", "--port", str(port)]
        if prometheus_port is not None:
            argv += ["--prometheus-port", str(prometheus_port)]
        self.lines: list[str] = []
        self._echo = echo
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        full_env = {**os.environ, **(env or {})}
        self.proc: DaemonHandle
        if spawn is not None:
            self.proc = spawn(argv, full_env, nofile)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcache.server", *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=full_env,
                preexec_fn=None if nofile is None else functools.partial(_limit_descriptors, nofile),
            )
        self._reader = threading.Thread(target=self._read, name="kvcache-daemon-log", daemon=True)
        self._reader.start()
        self.endpoint, self.ipc_endpoint, self.metrics_url = self._wait_ready(ready_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            self._queue.put(line)
            if self._echo:
                sys.stderr.write(line)
        self._queue.put(None)

    def _wait_ready(self, timeout_s: float) -> tuple[str, str, str]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.proc.wait()
                raise DaemonStartError(
                    f"kvcache daemon exited with status {self.proc.returncode}:\n{self.log}"
                )
            if match := _READY.search(line):
                return match["zmq"], match["ipc"], match["metrics"].strip()
        self.kill()
        raise DaemonStartError(f"kvcache daemon not ready after {timeout_s:g} s:\n{self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig`` and wait for the exit status (killing it after ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def remove_runtime_dir(self) -> None:
        """Remove the socket directory this object created (never a caller's)."""
        if self._own_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop()
        self.remove_runtime_dir()


__all__ = ["DaemonHandle", "DaemonProcess", "DaemonStartError", "Spawn"]
