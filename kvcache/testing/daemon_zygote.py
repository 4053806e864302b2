"""Start test daemons by forking a process that has already imported the daemon.

A daemon's start is mostly ``import torch`` (about 1.1 s of 1.4 s on the 2-core CI machine),
and the suite starts well over a hundred daemons, most of them in tests that need a fresh
process of their own (a flag, a kill, a restart). A zygote imports
``kvcache.server.__main__`` once, then forks one child per daemon; the child runs the same
``main(argv)`` as ``python -m kvcache.server``, with the caller's arguments, environment,
descriptor limit and stderr pipe, so what a test sees is the real daemon in its own process.

Tests opt in through ``DaemonProcess(..., spawn=zygote.spawn)``; a test of how the daemon
*starts* (its command line, imports, exit status before main) keeps the plain exec path.
The zygote reaps its children and reports each exit status over the connection that asked for
it, so ``ZygoteChild`` answers ``poll``/``wait`` like ``subprocess.Popen``.

Product code never imports this module (``tests/testing`` checks the whole package).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

_STATUS = struct.Struct("<qq")  # (pid, wait status); pid first so a reply is never ambiguous
_MAX_REQUEST = 1 << 20


class ZygoteChild:
    """A daemon forked by the zygote, with the part of ``subprocess.Popen`` that
    ``DaemonProcess`` and the tests use: ``pid``, ``stderr``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, conn: socket.socket, pid: int, stderr: IO[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None

    def _read_status(self, timeout: float | None) -> bool:
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(_STATUS.size, socket.MSG_WAITALL)
        except (TimeoutError, BlockingIOError):
            return False
        if len(data) != _STATUS.size:  # the zygote itself went away: the child went with it
            self.returncode = -signal.SIGKILL
        else:
            _, status = _STATUS.unpack(data)
            self.returncode = os.waitstatus_to_exitcode(status)
        self._conn.close()
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(f"daemon pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote process; ``spawn`` has the signature ``DaemonProcess`` expects of it."""

    def __init__(self, ready_timeout_s: float = 120.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvcache-zygote-")
        self.path = os.path.join(self._dir, "zygote.sock")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvcache.testing.daemon_zygote", self.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the zygote prints once it listens
        if line.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"daemon zygote did not start (got {line!r})")

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], nofile: tuple[int, int] | None
    ) -> ZygoteChild:
        """Fork a daemon running ``main(argv)`` with exactly ``env`` as its environment."""
        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps(
                {"argv": list(argv), "env": dict(env), "nofile": nofile, "cwd": os.getcwd()}
            ).encode()
            socket.send_fds(conn, [struct.pack("<I", len(request)) + request], [write_fd])
            (pid,) = struct.unpack("<q", conn.recv(8, socket.MSG_WAITALL))
        except BaseException:
            conn.close()
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child holds its own copy: EOF comes when it exits
        return ZygoteChild(conn, pid, os.fdopen(read_fd, "r"))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(30)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the zygote process ------------------------------------------------------------------------


def _child(request: dict[str, Any], stderr_fd: int, inherited: list[int]) -> None:
    """In the forked child: become ``python -m kvcache.server`` with the request's settings."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(stderr_fd, 2)
        os.close(devnull)
        os.close(stderr_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request["nofile"] is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
        from kvcache.server.__main__ import exit_now, main

        sys.argv = ["kvcache.server", *request["argv"]]
        exit_now(main(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        sys.stderr.flush()
        os._exit(code)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _serve(path: str) -> None:
    import kvcache.server.__main__  # noqa: F401  - the point of the zygote: imported once

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD reaches the wake fd
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    print("ready", flush=True)
    while not stop:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST + 4, 1)
                (size,) = struct.unpack("<I", msg[:4])
                while len(msg) < size + 4:
                    msg += conn.recv(size + 4 - len(msg))
                request = json.loads(msg[4:])
                inherited = [listener.fileno(), wake_r, wake_w, conn.fileno()]
                inherited += [c.fileno() for c in children.values()]
                pid = os.fork()
                if pid == 0:
                    _child(request, fds[0], inherited)
                os.close(fds[0])
                conn.sendall(struct.pack("<q", pid))
                children[pid] = conn
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while children:  # reap whoever exited and tell its owner
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            owner = children.pop(pid, None)
            if owner is not None:
                with contextlib.suppress(OSError):
                    owner.sendall(_STATUS.pack(pid, status))
                owner.close()
    for pid, owner in children.items():  # the session is over: no daemon outlives its zygote
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            owner.sendall(_STATUS.pack(pid, status))
        owner.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
