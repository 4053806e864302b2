"""Redis Cluster against one Redis server: ``python -m kvcache.bench l2 --redis-cluster``.

Its own module (beside ``storage``, which holds the flag) because the question is not one
tier's bandwidth but how a sharded tier scales and where the time goes. In one run, the
same chunks are stored and prefetched through a one-server tier and a cluster tier (local
``redis-server`` processes started by ``LocalRedis`` / ``LocalRedisCluster`` unless
``--redis-url`` / ``--cluster-url`` name running ones), each driven the way the engine
drives it: through ``AsyncL2`` with the engine's defaults (queue bound, wait bound), which
hands the adapter batches of up to ``max_batch`` chunks (``store_many``/``load_many``).
Targets and worker counts take turns within each repetition, so both see the same load.

Per phase it reports wall time and, for "where the time goes", this process's CPU seconds
(user: Python, redis-py, encoding and CRC; system: socket copies, which on loopback is the
network, and page faults on fresh buffers, ``client_faults_per_MiB``) and every server's
CPU seconds (``INFO cpu`` deltas). ``client_busy`` (client CPU over wall; near 1 means the
one Python process, which holds the GIL for most of its work, is the limit) and
``cpu_busy`` (all of it over wall and cores) say what bounds a phase; the CPU seconds per
GiB give what one client process and each master could move with a core of its own (the
``l2_cluster_projection`` row).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis
import torch

from kvcache.config import EngineConfig
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.base import L2Adapter
from kvcache.storage.l2.redis.cluster import RedisClusterL2Adapter
from kvcache.storage.l2.redis.single import RedisL2Adapter
from kvcache.storage.l2.redis.url import RedisTarget, parse_redis_url

GiB = float(1 << 30)
PREFIX = "kvcache-bench:"


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster comparison's flags, added to ``python -m kvcache.bench l2``."""
    p.add_argument("--redis-cluster", action="store_true",
                   help="compare one Redis server with a Redis Cluster (this module) instead "
                        "of the disk/Redis tier rows")  # fmt: skip
    p.add_argument("--cluster-url", help="redis+cluster://h:p,... of a running cluster "
                   "(default: start local redis-server processes)")  # fmt: skip
    p.add_argument("--cluster-masters", type=int, default=3)
    p.add_argument("--cluster-replicas", type=int, default=0,
                   help="replicas per master of the local cluster (default 0: the same "
                        "durability as the one server it is compared with)")  # fmt: skip
    p.add_argument("--workers", default="1,4",
                   help="AsyncL2 I/O threads to run, comma separated (the engine's default "
                        f"is {EngineConfig().l2_workers}; 1 shows pipelining alone)")  # fmt: skip


@dataclass
class Target:
    """One deployment under test: how to open a tier on it, and the servers whose CPU it uses."""

    name: str
    open: Callable[[], L2Adapter]
    masters: list[redis.Redis]
    replicas: list[redis.Redis] = field(default_factory=list)

    def server_cpu(self) -> tuple[list[float], list[float]]:
        """``used_cpu_user + used_cpu_sys`` of each master and each replica, seconds."""

        def cpu(c: redis.Redis) -> float:
            info = c.info("cpu")
            return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

        return [cpu(c) for c in self.masters], [cpu(c) for c in self.replicas]


@dataclass(frozen=True)
class Sample:
    """One timed phase: wall time and the CPU every process spent in it, seconds."""

    wall: float
    client_user: float
    client_sys: float
    client_faults: int
    masters: tuple[float, ...]
    replicas: float


def _measure(target: Target, phase: Callable[[], None]) -> Sample:
    m0, r0 = target.server_cpu()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    phase()
    wall = time.perf_counter() - t0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    m1, r1 = target.server_cpu()
    return Sample(
        wall,
        u1.ru_utime - u0.ru_utime,
        u1.ru_stime - u0.ru_stime,
        u1.ru_minflt - u0.ru_minflt,
        tuple(b - a for a, b in zip(m0, m1, strict=True)),
        sum(r1) - sum(r0),
    )


def _store(tier: AsyncL2, keys: list[int], chunk: torch.Tensor, wait_s: float) -> None:
    done: list[bool] = []
    for key in keys:
        if not tier.submit_store(key, chunk, done.append, wait_s):
            raise RuntimeError(f"{tier.backend}: store refused")
    tier.flush()
    if len(done) != len(keys) or not all(done):
        raise RuntimeError(f"{tier.backend}: {done.count(False)} of {len(keys)} stores failed")


def _load(tier: AsyncL2, keys: list[int], outs: list[torch.Tensor], wait_s: float) -> None:
    done: list[bool] = []
    for key, out in zip(keys, outs, strict=True):
        if not tier.submit_load(key, out, done.append, wait_s):
            raise RuntimeError(f"{tier.backend}: load refused")
    tier.flush()
    if len(done) != len(keys) or not all(done):
        raise RuntimeError(f"{tier.backend}: {done.count(False)} of {len(keys)} loads missed or failed")


def _node(target: RedisTarget, host: str, port: int) -> redis.Redis:
    return redis.Redis(host=host, port=port, username=target.username, password=target.password,
                       ssl=target.tls, socket_timeout=30)  # fmt: skip


def _cluster_nodes(url: str) -> tuple[list[redis.Redis], list[redis.Redis]]:
    """Clients of the cluster's masters (those serving slots) and replicas, from a seed."""
    target = parse_redis_url(url)
    with _node(target, *target.nodes[0]) as seed:
        table = seed.cluster("nodes")
    masters, replicas = [], []
    for addr, node in sorted(table.items()):
        flags = node["flags"].split(",")
        if "fail" in flags or "noaddr" in flags:
            continue
        host, port = addr.rsplit(":", 1)
        client = _node(target, host or target.nodes[0][0], int(port.split("@")[0]))
        if "master" in flags and node.get("slots"):
            masters.append(client)
        elif "slave" in flags:
            replicas.append(client)
    return masters, replicas


def run(a: argparse.Namespace, chunk: torch.Tensor) -> list[dict[str, Any]]:
    """Start (or reach) both deployments, run every phase ``a.reps`` times, return the rows."""
    from kvcache.testing.redis_cluster_local import LocalRedisCluster
    from kvcache.testing.redis_local import LocalRedis

    workers = [int(w) for w in a.workers.split(",")]
    single = None if a.redis_url else LocalRedis().start()
    cluster = None
    if not a.cluster_url:
        cluster = LocalRedisCluster(masters=a.cluster_masters, replicas=a.cluster_replicas)
    targets: list[Target] = []
    try:
        if cluster is not None:
            cluster.start()
        single_url = a.redis_url or single.url  # type: ignore[union-attr]
        cluster_url = a.cluster_url or cluster.url  # type: ignore[union-attr]
        targets.append(Target(
            "redis", lambda: RedisL2Adapter(single_url, socket_timeout_s=30, key_prefix=PREFIX),
            [redis.Redis.from_url(single_url, socket_timeout=30)],
        ))  # fmt: skip
        targets.append(Target(
            "redis-cluster",
            lambda: RedisClusterL2Adapter(cluster_url, socket_timeout_s=30, key_prefix=PREFIX),
            *_cluster_nodes(cluster_url),
        ))  # fmt: skip
        return _rows(a, chunk, targets, workers)
    finally:
        for t in targets:
            for c in t.masters + t.replicas:
                c.close()
        if cluster is not None:
            cluster.close()
        if single is not None:
            single.close()


def _rows(
    a: argparse.Namespace, chunk: torch.Tensor, targets: list[Target], workers: list[int]
) -> list[dict[str, Any]]:
    """Best-of-``a.reps`` samples per (deployment, op, workers), as rows plus ratios."""
    cfg = EngineConfig(chunk_size=a.chunk_size)
    wait = cfg.store_wait_timeout_s
    n, cbytes = a.chunks, chunk.numel() * chunk.element_size()
    nbytes = n * cbytes
    outs = [torch.empty_like(chunk) for _ in range(n)]
    raw = chunk.view(torch.uint8)
    # The engine's queue bound; each AsyncL2 gets an adapter of its own (close() closes it).
    tiers = {(t.name, w): AsyncL2(t.open(), workers=w, max_inflight=cfg.l2_max_inflight)
             for t in targets for w in workers}  # fmt: skip
    best: dict[tuple[str, str, int], Sample] = {}
    spread: list[int] = []
    try:
        for rep in range(-1, a.reps):  # rep -1: an untimed warm-up (connections, slot table)
            for w in workers:
                for t in targets:
                    tier = tiers[(t.name, w)]
                    keys = [(rep + 2) << 64 | w << 32 | k for k in range(n)]
                    samples = {
                        "store": _measure(t, partial(_store, tier, keys, chunk, wait)),
                        "load": _measure(t, partial(_load, tier, keys, outs, wait)),
                    }
                    if t.name == "redis-cluster" and not spread:
                        spread = [int(c.dbsize()) for c in t.masters]
                    bad = sum(not torch.equal(o.view(torch.uint8), raw) for o in outs)  # bytes: NaN != NaN
                    if bad:
                        raise RuntimeError(f"{t.name}: {bad} chunks came back different")
                    tier.adapter.delete(keys)
                    for op, s in samples.items():
                        old = best.get((t.name, op, w))
                        if rep >= 0 and (old is None or s.wall < old.wall):
                            best[(t.name, op, w)] = s
    finally:
        for tier in tiers.values():
            tier.close()
    ncpu = os.cpu_count() or 1
    adapter = tiers[(targets[0].name, workers[0])].adapter
    batch = min(adapter.max_batch, max(1, adapter.max_batch_bytes // cbytes))  # as AsyncL2 takes them
    rows: list[dict[str, Any]] = []
    for (name, op, w), s in best.items():
        server = sum(s.masters)
        rows.append({
            "bench": f"l2_{name}_{op}", "workers": w, "chunk_MiB": cbytes / (1 << 20),
            "batch": batch,
            "GiBps": nbytes / s.wall / GiB, "wall_s": s.wall, "client_user_s": s.client_user,
            "client_sys_s": s.client_sys, "server_s": server, "replica_s": s.replicas,
            "client_faults_per_MiB": s.client_faults / (nbytes / (1 << 20)),
            "client_busy": (s.client_user + s.client_sys) / s.wall,
            "cpu_busy": (s.client_user + s.client_sys + server + s.replicas) / (s.wall * ncpu),
            "client_cpu_s_per_GiB": (s.client_user + s.client_sys) / (nbytes / GiB),
            "server_cpu_s_per_GiB": server / (nbytes / GiB),
        })  # fmt: skip
    for op in ("store", "load"):
        for w in workers:
            one, many = best[("redis", op, w)], best[("redis-cluster", op, w)]
            rows.append({"bench": f"l2_cluster_over_single_{op}", "workers": w,
                         "ratio": one.wall / many.wall, "masters": len(targets[1].masters)})  # fmt: skip
    rows.append(_projection(best, workers, nbytes, spread))
    return rows


def _projection(
    best: dict[tuple[str, str, int], Sample], workers: list[int], nbytes: int, spread: list[int]
) -> dict[str, Any]:
    """What the measured CPU seconds per GiB add up to with a core per process (an estimate:
    ceilings from CPU cost alone, with no network or memory-bandwidth limit)."""
    w = max(workers)
    gib = nbytes / GiB
    row: dict[str, Any] = {"bench": "l2_cluster_projection", "workers": w, "keys_per_master": spread}
    for op in ("store", "load"):
        one, many = best[("redis", op, w)], best[("redis-cluster", op, w)]
        node_rate = gib / max(sum(one.masters), 1e-9)  # one server, on a core of its own
        per_master = [gib * share / max(cpu, 1e-9) for share, cpu in
                      zip(_shares(spread, len(many.masters)), many.masters, strict=True)]  # fmt: skip
        client_rate = gib / max(many.client_user + many.client_sys, 1e-9)
        # A fleet of daemons loads every master evenly: the slowest master bounds the sum.
        row[f"{op}_node_GiBps"] = node_rate
        row[f"{op}_per_master_GiBps"] = [round(r, 3) for r in per_master]
        row[f"{op}_cluster_servers_GiBps"] = min(per_master) * len(per_master)
        row[f"{op}_one_client_GiBps"] = client_rate
    return row


def _shares(spread: list[int], masters: int) -> list[float]:
    """Each master's fraction of the keys (even when the spread is unknown)."""
    total = sum(spread)
    if len(spread) != masters or not total:
        return [1.0 / masters] * masters
    return [k / total for k in spread]


__all__ = ["add_cluster_args", "run"]
