"""A throwaway Redis Cluster of local ``redis-server`` processes, for tests and benchmarks.

Beside ``redis_local`` for the same reason: the cluster tests, ``python -m kvcache.bench l2
--redis-cluster`` and an operator trying the docs all start a cluster the same way, the way
docs/cluster.md tells an operator to (``--cluster-enabled yes`` servers joined by
``redis-cli --cluster create``), and can SIGKILL one master to watch a failover. Loopback
only, no persistence, a short ``cluster-node-timeout`` so a replica takes over in seconds.
"""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One server: its port, its cluster node id and, for a replica, its master's id."""

    port: int
    node_id: str
    master_id: str | None


def _free_cluster_port(taken: set[int]) -> int:
    """A loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` every 20 ms until it holds; ``TimeoutError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class LocalRedisCluster:
    """``with LocalRedisCluster(masters=3, replicas=1) as c: c.url``.

    ``kill(port)`` SIGKILLs one server; ``wait_promoted(port)`` waits until another node owns
    its slots and the cluster answers again. Raises ``FileNotFoundError`` (with the package
    to install) when ``redis-server`` or ``redis-cli`` is missing, so tests can skip.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            missing = "redis-server" if server is None else "redis-cli"
            raise FileNotFoundError(f"{missing} not found on PATH (Debian: apt-get install redis-server)")
        self.server, self.cli = server, cli
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.node_timeout_ms = node_timeout_ms
        taken: set[int] = set()
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            port = _free_cluster_port(taken)
            taken |= {port, port + 10000}
            self.ports.append(port)
        self.replicas = replicas
        self._dir = tempfile.mkdtemp(prefix="kvcache-cluster-")
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The daemon's ``--l2-redis-url``: every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def client(self, port: int) -> redis.Redis:
        """A plain (non-cluster) client of one node, for CLUSTER / INFO / DBSIZE."""
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=1)

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        for port in self.ports:
            self._spawn(port)
        for port in self.ports:
            wait_until(functools.partial(self._pings, port), timeout, f"redis-server on port {port}")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas),
                  "--cluster-yes"]  # fmt: skip
        out = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        wait_until(self.healthy, timeout, "cluster_state:ok with every replica in sync")
        return self

    def _spawn(self, port: int) -> None:
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--dir", self._dir,
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--dbfilename", f"dump-{port}.rdb", "--repl-diskless-sync-delay", "0"]  # fmt: skip
        self._procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _pings(self, port: int) -> bool:
        proc = self._procs.get(port)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with self.client(port) as c:
                return bool(c.ping())
        except redis.ConnectionError:
            return False

    # -- topology ------------------------------------------------------------------------
    def nodes(self, via: int | None = None) -> list[ClusterNode]:
        """Live view of the cluster (``CLUSTER NODES`` of ``via``, default a running node)."""
        port = via if via is not None else self.running_ports()[0]
        with self.client(port) as c:
            table = c.cluster("nodes")
        out = []
        for addr, node in table.items():
            flags = node["flags"].split(",")
            if "fail" in flags or "noaddr" in flags:
                continue
            master = None if node["master_id"] == "-" else node["master_id"]
            out.append(ClusterNode(int(addr.rsplit(":", 1)[1]), node["node_id"], master))
        return out

    def slot_map(self, via: int | None = None) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """``CLUSTER SLOTS`` of ``via`` (default a running node): (first, last, master port,
        replica ports) per slot range."""
        port = via if via is not None else self.running_ports()[0]
        with self.client(port) as c:
            rows = c.execute_command("CLUSTER SLOTS")
        return sorted(
            (int(lo), int(hi), int(m[1]), tuple(int(r[1]) for r in reps)) for lo, hi, m, *reps in rows
        )

    def masters(self) -> list[int]:
        """Ports of the masters that serve slots now."""
        return sorted({master for _, _, master, _ in self.slot_map()})

    def running_ports(self) -> list[int]:
        return [p for p, proc in self._procs.items() if proc.poll() is None]

    def owner_of(self, slot: int) -> int:
        """Port of the master serving ``slot``."""
        for lo, hi, master, _ in self.slot_map():
            if lo <= slot <= hi:
                return master
        raise LookupError(f"slot {slot} is not served")

    def healthy(self) -> bool:
        """Every running node says ``cluster_state:ok`` and sees the same slot owners, and each
        master has its replicas in sync (replication ``online``), so a failover can happen.

        NOTE: ``CLUSTER SLOTS`` may list a new replica only seconds later (gossip); that does
        not delay a failover, so it is not waited for."""
        try:
            maps = set()
            for port in self.running_ports():
                with self.client(port) as c:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
                    info = c.info("replication")
                    if info.get("role") == "master" and self.replicas:
                        links = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                        if sum(1 for v in links if v.get("state") == "online") < self.replicas:
                            return False
                maps.add(tuple((lo, hi, master) for lo, hi, master, _ in self.slot_map(port)))
            return len(maps) == 1
        except (redis.RedisError, ValueError):
            return False

    # -- failure ---------------------------------------------------------------------------
    def kill(self, port: int) -> None:
        """SIGKILL one server: the abrupt loss of a machine."""
        proc = self._procs.pop(port)
        proc.kill()
        proc.wait()

    def wait_promoted(self, dead: int, timeout: float = 30.0) -> int:
        """Wait until the slots of ``dead`` are served by another node and every running node
        reports ``cluster_state:ok``; returns the new owner's port."""
        slots = [lo for lo, _, master, _ in self.slot_map() if master == dead]
        if not slots:
            raise LookupError(f"port {dead} serves no slots")

        def promoted() -> bool:
            try:
                return self.owner_of(slots[0]) != dead and all(
                    self.client(p).cluster("info").get("cluster_state") == "ok" for p in self.running_ports()
                )
            except (redis.RedisError, LookupError):
                return False

        wait_until(promoted, timeout, f"a replica to take over the slots of port {dead}")
        return self.owner_of(slots[0])

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self._procs.values():
            proc.kill()
            proc.wait()
        self._procs.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ClusterNode", "LocalRedisCluster", "wait_until"]
