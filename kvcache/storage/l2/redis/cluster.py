"""Redis / Valkey Cluster L2: one prefix store shared by a fleet, sharded and replicated.

Its own module (beside the one-server ``single``) because a cluster fails by parts: when one
master dies, only the chunks in its hash slots are lost for a while, and the daemons must keep
serving everything else. So this tier

* keeps one chunk per key, with no hash tag: a prompt's chunks spread over every shard, and no
  operation ever spans two slots;
* leaves routing, ``MOVED``/``ASK`` redirections and topology refreshes to redis-py's cluster
  client, and only groups a batch by the master that serves each key (from the client's own
  slot table), so each shard gets one pipelined round trip and fails alone;
* marks a shard that stopped answering as down for ``shard_retry_s``: its keys then fail at
  once (``unavailable``, ``scope="shard"``), without a connection attempt, while the other
  shards answer. The first call after that interval goes through the client, which refreshes
  its slot table on the connection error; once a replica has been promoted the slots route
  to it and the shard is back, with no restart and no operator action;
* connects lazily: a daemon starts (and serves from L1) while the cluster is unreachable;
* given an event sink, reports the chunks every master expires or evicts by itself
  (``redis_cluster_notify``), as the one-server tier does.

Values use the one-server record format (``redis.encode_or_error``/``decoded``): header + CRC,
so a chunk from another build or geometry is refused, never served; sealed (``seal``) as
there, so a record the fleet's key did not seal is refused too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, TryAgainError
from redis.retry import Retry

from kvcache.errors import RedisURLError, StorageError
from kvcache.observability.event import EventSink, NullEventBus
from kvcache.records import ChunkKey
from kvcache.storage.l2.base import failure_reason, storage_error
from kvcache.storage.l2.redis.cluster_notify import ClusterEvictionWatcher
from kvcache.storage.l2.redis.seal import RecordSeal
from kvcache.storage.l2.redis.single import DEFAULT_MAX_BATCH, PipelinedChunks, storage_failure
from kvcache.storage.l2.redis.url import parse_redis_url

logger = logging.getLogger(__name__)
_SHARD_DOWN_REASONS = ("unavailable", "timeout")
# Refusals that a live master answers with (CLUSTERDOWN while any slot is unserved under
# cluster-require-full-coverage yes, TRYAGAIN during a migration): they fail the keys but
# never put the master into fail-fast, or a failover elsewhere would silence it.
_ANSWERED = (ClusterDownError, TryAgainError)


class ShardHealth:
    """Which masters are failing fast, and the one log line per shard outage.

    A shard enters on a connection-level failure (WARNING), fails fast until ``retry_s`` has
    passed, and leaves when it answers again or no longer serves any slot (INFO): so a dead
    master costs one connection attempt per ``retry_s`` and two log lines, not one per chunk.
    """

    def __init__(self, retry_s: float, clock: Callable[[], float]) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._retry_at: dict[str, float] = {}  # node name -> when to try it again

    def blocked_for(self, node: str) -> float:
        """Seconds ``node`` still fails fast (0: try it)."""
        if not self._retry_at:  # read without the lock: the healthy case costs nothing
            return 0.0
        with self._lock:
            at = self._retry_at.get(node)
        return 0.0 if at is None else max(0.0, at - self._clock())

    def failed(self, node: str, err: StorageError) -> None:
        with self._lock:
            first = node not in self._retry_at
            self._retry_at[node] = self._clock() + self.retry_s
        if first:
            logger.warning(
                "redis cluster shard %s is down (%s); its slots fail fast, retried every %.3g s "
                "until it answers or a replica takes over: %s",
                node, getattr(err, "reason", "io"), self.retry_s, err,
            )  # fmt: skip

    def answered(self, node: str) -> None:
        if self._retry_at and self._forget(node):
            logger.info("redis cluster shard %s: its slots answer again", node)

    def forget_unrouted(self, routed: set[str]) -> None:
        """End the outage of shards the slot table no longer routes to (replaced by a replica)."""
        for node in [n for n in list(self._retry_at) if n not in routed]:
            if self._forget(node):
                logger.info("redis cluster shard %s serves no slots any more (a replica took over)", node)

    def _forget(self, node: str) -> bool:
        with self._lock:
            return self._retry_at.pop(node, None) is not None

    def down(self) -> dict[str, float]:
        """Shards in an outage -> seconds until the next try."""
        with self._lock:
            now = self._clock()
            return {n: round(max(0.0, at - now), 3) for n, at in self._retry_at.items()}


class RedisClusterL2Adapter(PipelinedChunks):
    """Values ``<prefix><32 hex digits of the key>`` = header + payload, spread over the slots."""

    backend = "redis-cluster"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvcache:",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
        ttl_s: int | None = None,
        shard_retry_s: float = 5.0,
        max_connections_per_node: int = 32,
        max_batch: int = DEFAULT_MAX_BATCH,
        clock: Callable[[], float] = time.monotonic,
        bus: EventSink | None = None,
        seal: RecordSeal | None = None,
    ) -> None:
        target = parse_redis_url(url)
        if not target.cluster:
            raise RedisURLError(f"a cluster tier needs a redis+cluster:// URL, got {target.redacted()!r}")
        self.target = target
        self.seal = seal
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_batch = max_batch
        self.shards = ShardHealth(shard_retry_s, clock)
        self._options: dict[str, Any] = {
            "startup_nodes": [ClusterNode(host, port) for host, port in target.nodes],
            "username": target.username,
            "password": target.password,
            "ssl": target.tls,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "max_connections": max_connections_per_node,
            # One retry after the client refreshed its slot table: enough to follow a failover
            # that already happened; a shard still down then fails fast on our side.
            "retry": Retry(NoBackoff(), 1),
            # The other shards keep serving when one slot range has no master.
            "require_full_coverage": False,
        }
        self._client: RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._closed = False
        # Keys the masters drop by themselves (TTL, maxmemory) reach the bus as L2_KEYS_EVICTED;
        # the master set is re-read as often as a dead shard is retried.
        self._watcher: ClusterEvictionWatcher | None = None
        if bus is not None and not isinstance(bus, NullEventBus):
            self._watcher = ClusterEvictionWatcher(
                target,
                key_prefix=key_prefix,
                backend=self.backend,
                bus=bus,
                refresh_s=shard_retry_s,
                socket_timeout_s=socket_timeout_s,
                connect_timeout_s=connect_timeout_s,
            )

    # -- L2Adapter ------------------------------------------------------------------------
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        replies = self._run("delete", [("DEL", self._name(k)) for k in keys])
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return sum(int(r) for r in replies)

    def info(self) -> dict[str, Any]:
        """Seeds, the masters the client routes to now, the shards failing fast and the masters
        whose expiries/evictions are followed (node -> state, or ``"off"``); no I/O."""
        client = self._client
        masters = sorted(n.name for n in client.get_primaries()) if client is not None else []
        return {
            "backend": self.backend,
            "url": self.target.redacted(),
            "key_prefix": self.key_prefix,
            "records_sealed": self.seal is not None,
            "masters": masters,
            "shards_down": self.shards.down(),
            "evictions_watched": self._watcher.watched() if self._watcher is not None else "off",
        }

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        with self._client_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- internals ------------------------------------------------------------------------
    def _drop_corrupt(self, keys: list[ChunkKey]) -> None:
        # A failed delete leaves a miss: the next load finds it corrupt again.
        self._run("delete", [("DEL", self._name(k)) for k in keys])

    def _cluster(self) -> RedisCluster:
        """The client, created on first use (it reads the slot table from a seed)."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._closed:
                raise storage_error("redis cluster tier is closed", "unavailable")
            if self._client is None:
                try:
                    self._client = RedisCluster(**self._options)
                except Exception as exc:
                    raise storage_failure(exc, "connect", where="redis cluster") from exc
            return self._client

    def _run(self, op: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` (one key each, the second item), one pipeline per master; per
        command the reply or a tagged ``StorageError``. A shard's failure fails only its keys."""
        if not commands:
            return []
        try:
            client = self._cluster()
        except StorageError as exc:
            return [exc] * len(commands)
        results: list[Any] = [None] * len(commands)
        for node, indices in self._by_master(client, op, commands, results).items():
            blocked = self.shards.blocked_for(node)
            if blocked:
                err = storage_error(
                    f"redis cluster {op}: shard {node} is down (next try in {blocked:.3g} s)",
                    "unavailable",
                    "shard",
                )
                for i in indices:
                    results[i] = err
                continue
            self._run_on(client, op, node, [commands[i] for i in indices], indices, results)
        return results

    def _by_master(
        self, client: RedisCluster, op: str, commands: Sequence[tuple[Any, ...]], results: list[Any]
    ) -> dict[str, list[int]]:
        """Command indices per master name, from the client's slot table; a key whose slot
        no master serves gets its error in ``results`` here."""
        groups: dict[str, list[int]] = {}
        for i, cmd in enumerate(commands):
            try:
                groups.setdefault(client.get_node_from_key(cmd[1]).name, []).append(i)
            except Exception as exc:
                results[i] = storage_failure(exc, op, "shard", "redis cluster")
        if self.shards.down():  # an outage may have ended by a failover: forget replaced shards
            self.shards.forget_unrouted({n.name for n in client.get_primaries()})
        return groups

    def _run_on(
        self,
        client: RedisCluster,
        op: str,
        node: str,
        commands: list[tuple[Any, ...]],
        indices: list[int],
        results: list[Any],
    ) -> None:
        """One pipeline for the commands of one master (redirections followed by redis-py)."""
        where = f"redis cluster shard {node}"
        try:
            pipe = client.pipeline()
            for cmd in commands:
                pipe.execute_command(*cmd)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            replies = [exc] * len(commands)
        down: StorageError | None = None
        for i, reply in zip(indices, replies, strict=True):
            if isinstance(reply, Exception):
                reply = storage_failure(reply, op, "shard", where)
                if failure_reason(reply) in _SHARD_DOWN_REASONS and not isinstance(
                    reply.__cause__, _ANSWERED
                ):
                    down = reply
            results[i] = reply
        if down is not None:
            self.shards.failed(node, down)
        else:
            self.shards.answered(node)


__all__ = ["RedisClusterL2Adapter", "ShardHealth"]
