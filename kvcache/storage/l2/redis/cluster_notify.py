"""Chunks a Redis Cluster's masters drop by themselves (TTL expiry, ``maxmemory`` eviction) as
L2 events: one keyspace-notification watcher per master, following the cluster's topology.

Separate from the one-server watcher (``notify``), which it reuses unchanged per node,
because what a cluster adds is bookkeeping of *which* servers to watch: Redis Cluster
publishes keyspace notifications only on the node where the key lived (they never cross the
cluster bus), so every master must be followed, and the set of masters changes when a
replica is promoted after its master died, or when an operator adds or removes a shard.

A supervisor thread asks the cluster for its slot table (``CLUSTER SLOTS``, from the nodes it
knows, then the URL's seeds) at start and every ``refresh_s``, starts a
``RedisEvictionWatcher`` (which switches ``notify-keyspace-events`` on for that node) for
each master it does not follow yet and closes the watchers of nodes that no longer serve
slots. Replicas are never watched: they do not expire or evict keys themselves (their master
sends them a ``DEL``), so each dropped key is reported once per daemon.

Its own plain connections, not the tier's cluster client: the adapter's client is used from
the engine's I/O threads, and refreshing its slot table from here would reset their
connections. Limits: a key that expires on a master between its promotion and the next
refresh is never reported (notifications are not queued), nor one on a master that is down.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import redis

from kvcache.observability.event import EventSink
from kvcache.storage.l2.redis.notify import RedisEvictionWatcher
from kvcache.storage.l2.redis.url import RedisTarget

log = logging.getLogger(__name__)

Node = tuple[str, int]


class ClusterEvictionWatcher:
    """Publishes ``L2_KEYS_EVICTED`` (``backend`` as given) for the chunk keys every master
    of the cluster expires or evicts. Starts at once and returns; ``watched()`` says which
    masters are followed, and how (the one-server states). ``close()`` stops every thread."""

    def __init__(
        self,
        target: RedisTarget,
        *,
        key_prefix: str,
        backend: str,
        bus: EventSink,
        refresh_s: float = 5.0,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self._target = target
        self._key_prefix = key_prefix
        self._backend = backend
        self._bus = bus
        self._refresh_s = refresh_s
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._known: list[Node] = []  # every node of the last slot table, masters first
        # Replaced, never mutated, so ``watched()`` reads it from any thread without a lock.
        self._watchers: dict[Node, RedisEvictionWatcher] = {}
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-cluster-evictions", daemon=True)
        self._thread.start()

    def watched(self) -> dict[str, str]:
        """``host:port`` of each master followed -> its ``notify-keyspace-events`` state
        (``on``, ``enabled``, ``unknown``; see ``notify``)."""
        return {f"{h}:{p}": w.state for (h, p), w in sorted(self._watchers.items())}

    def close(self) -> None:
        self._halt.set()
        self._thread.join(10)
        watchers, self._watchers = self._watchers, {}
        for w in watchers.values():
            w.close()

    # -- internals ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt.is_set():
            masters = self._masters()
            if masters is not None:
                self._follow(masters)
            self._halt.wait(self._refresh_s)

    def _follow(self, masters: list[Node]) -> None:
        """Start watchers for new masters, close those of nodes that serve no slots now."""
        current = self._watchers
        gone = [n for n in current if n not in masters]
        kept = {n: w for n, w in current.items() if n in masters}
        for node in masters:
            if node not in kept and not self._halt.is_set():
                kept[node] = RedisEvictionWatcher(
                    self._client(node),
                    key_prefix=self._key_prefix,
                    backend=self._backend,
                    bus=self._bus,
                    where=f"Redis cluster node {node[0]}:{node[1]}",
                )
                if current or gone:  # not the first sight of the cluster: a topology change
                    log.info("Redis cluster: following expired/evicted chunks on new master %s:%d", *node)
        self._watchers = kept
        for node in gone:
            log.info("Redis cluster: %s:%d serves no slots any more; no longer followed", *node)
            current[node].close()

    def _masters(self) -> list[Node] | None:
        """The masters in the slot table of the first node that answers (known nodes first,
        then the seeds); None when none does (tried again after ``refresh_s``)."""
        candidates = list(dict.fromkeys([*self._known, *self._target.nodes]))
        for node in candidates:
            if self._halt.is_set():
                return None
            client = self._client(node)
            try:
                rows = client.execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    client.close()
            masters: dict[Node, None] = {}
            replicas: dict[Node, None] = {}
            for row in rows:
                masters[_address(row[2], node)] = None
                for rep in row[3:]:
                    replicas[_address(rep, node)] = None
            self._known = [*masters, *(r for r in replicas if r not in masters)]
            return sorted(masters)
        return None

    def _client(self, node: Node) -> redis.Redis:
        t = self._target
        return redis.Redis(
            host=node[0],
            port=node[1],
            username=t.username,
            password=t.password,
            ssl=t.tls,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._connect_timeout_s,
        )


def _address(entry: Any, answered_by: Node) -> Node:
    """(host, port) of one ``CLUSTER SLOTS`` node entry; an empty or unknown host means the
    node that answered (Redis: "the same endpoint as the one that sent the request")."""
    host = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0])
    if host in ("", "?"):
        host = answered_by[0]
    return host, int(entry[1])


__all__ = ["ClusterEvictionWatcher"]
