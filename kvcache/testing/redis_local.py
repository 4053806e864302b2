"""A throwaway local ``redis-server`` on a free loopback port, for tests, benchmarks and demos.

Lives beside the Redis adapter so that the test suites, ``python -m kvcache.bench l2`` and the CI
script all start the real server the same way (no persistence, no protected mode, bound to
127.0.0.1) and can kill it mid-run to exercise the failure paths.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """``with LocalRedis() as r: r.url``; ``stop()`` kills it, ``start()`` brings it back (same port)."""

    def __init__(self, binary: str = "redis-server", port: int | None = None) -> None:
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} not found on PATH (Debian: apt-get install redis-server)")
        self.binary = path
        self.port = port if port is not None else free_port()
        self._port_fixed = port is not None
        self._dir = tempfile.mkdtemp(prefix="kvcache-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> LocalRedis:
        """Start the server and wait until it answers. A port picked here may be taken by
        another process between ``free_port()`` and the server's bind (parallel test workers
        do this): the first start then picks another port, and a server that answers is
        only taken for ours when its ``process_id`` is our child's."""
        if self.running:
            return self
        for _ in range(5):
            if self._launch(timeout):
                self._port_fixed = True  # a restart keeps the port clients know
                return self
            if self._port_fixed:
                break
            self.port = free_port()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _launch(self, timeout: float) -> bool:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--dir", self._dir]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._proc = proc
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if int(client.info("server")["process_id"]) == proc.pid:
                        return True
                except redis.ConnectionError:
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        return False

    def stop(self) -> None:
        """Kill the server (SIGKILL: the failure test wants an abrupt loss)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LocalRedis", "free_port"]
