"""Start and stop a kvcache daemon subprocess for the workload benchmark, KV events on or off.

Separate from the workload driver because it is process plumbing: free ports, readiness,
SIGTERM. While ``python -m kvcache.server`` does not yet know ``--kv-events-*``, running this
module (``python -m kvcache.bench.workload_daemon``) serves the same daemon with the KV-events
subscriber wired onto its bus, exactly as the server will once it has the flags.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import kvcache
from kvcache.transport.endpoints import ipc_endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_knows_kv_events() -> bool:
    from kvcache.server.flags import build_parser

    parser, _ = build_parser()
    return "--kv-events-endpoint" in parser._option_string_actions


class WorkloadDaemon:
    """One daemon subprocess for the workload benchmark, on free ports, KV events on or off;
    ``endpoint`` for clients, ``metrics_url`` to scrape."""

    def __init__(
        self, flags: Sequence[str], kv_events_endpoint: str | None = None, log_path: str | None = None
    ) -> None:
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.runtime_dir = tempfile.mkdtemp(prefix="kvcache-bench-")  # its own Unix sockets
        self.endpoint = ipc_endpoint(self.runtime_dir)
        argv = [*flags, "--prometheus-port", str(self.metrics_port),
                "--runtime-dir", self.runtime_dir, "--log-level", "WARNING"]  # fmt: skip
        module = "kvcache.server"
        if kv_events_endpoint is not None:
            argv += ["--kv-events-endpoint", kv_events_endpoint]
            if not server_knows_kv_events():
                module = "kvcache.bench.workload_daemon"
        env = dict(os.environ)
        root = str(Path(kvcache.__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)  # fmt: skip

    def wait_ready(self, timeout: float = 120.0) -> None:
        from kvcache.client import KVCacheClient

        deadline = time.monotonic() + timeout
        client = KVCacheClient(self.endpoint, timeout_s=1.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with status {self.proc.returncode}")
                try:
                    client.ping()  # answers (False: instance not registered yet) once serving
                    return
                except Exception:
                    time.sleep(0.1)
        finally:
            client.close(unregister=False)
        raise TimeoutError("daemon did not answer a ping")

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, every thread) the daemon used so far; None off Linux."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return self.proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    """The daemon's ``main`` plus the KV-events flags (see the module docstring)."""
    import logging

    from kvcache.engine.engine import CacheEngine
    from kvcache.kv_events import add_kv_events_args, build_kv_events_subscriber
    from kvcache.observability import init_observability
    from kvcache.server.daemon import Daemon
    from kvcache.server.handlers import Handlers
    from kvcache.server.registry import InstanceRegistry
    from kvcache.server.settings import parse_settings

    kv_ns, rest = add_kv_events_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    settings = parse_settings(rest)
    logging.basicConfig(level=settings.log_level)
    obs = init_observability(settings.observability)
    kv_ns.chunk_size = settings.engine.chunk_size
    sub = build_kv_events_subscriber(kv_ns, obs.registry)
    if sub is not None:
        obs.bus.register_subscriber(sub)
        obs.subscribers.append(sub)
    engine = CacheEngine(settings.engine, bus=obs.bus)
    handlers = Handlers(engine, InstanceRegistry(), settings.daemon.heartbeat_timeout_s)
    daemon = Daemon(settings.daemon, handlers)

    def stop(signum: int, frame: FrameType | None) -> None:
        daemon.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        daemon.serve()
    finally:
        engine.close()
        obs.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
