"""Chunks a Redis server drops by itself (TTL expiry, ``maxmemory`` eviction) as L2 events.

Separate from the Redis tier because it is the one part of it that runs on its own thread and
connection: kvcache never asks Redis which keys it still holds, so without this a chunk that
expired or was evicted stayed "held" for every holdings tracker (KV events kept announcing it
to routers as ``STORAGE``). The server says so itself through keyspace notifications
(``notify-keyspace-events``; ``E`` = keyevent channels, ``x`` = expired, ``e`` = evicted),
which are off by default.

At start the watcher reads the setting and, when ``E``, ``x`` or ``e`` is missing, adds them
(``CONFIG SET``, keeping whatever else is on); a server that refuses (managed services, an ACL
without ``+config``) gets a warning naming the setting. Either way it subscribes, so a setting
made by hand later still works. State, for ``info()``: ``"on"`` (already set), ``"enabled"``
(set by us), ``"unknown"`` (could not read or set it), ``"off"`` (no event sink, no watcher).

Limits (documented in docs/operator-guide.md): notifications are fire-and-forget, so keys that
expire while the watcher is disconnected are never reported; every daemon sharing the server
reports every expiry under the prefix (holdings trackers ignore keys they never held).

A Redis Cluster publishes keyspace notifications only on the node where the key lived, so the
cluster tier runs one of these per master (``redis_cluster_notify``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import redis

from kvcache.observability.event import Event, EventSink, EventType, L2KeysEvicted
from kvcache.records import ChunkKey

log = logging.getLogger(__name__)

#: The ``notify-keyspace-events`` classes the watcher needs.
NEEDED = "Exe"
_A_ALIAS = "g$lshzxetd"  # what the "A" class stands for (Redis docs)
_HEX_LEN = 32  # chunk names end in 32 hex digits (``redis.chunk_name``)


def covers(flags: str) -> bool:
    """True when ``notify-keyspace-events`` ``flags`` publish expired and evicted keyevents."""
    have = set(flags) | (set(_A_ALIAS) if "A" in flags else set())
    return set(NEEDED) <= have


class RedisEvictionWatcher:
    """Follows one server's expired/evicted keyevents for names under ``key_prefix`` and
    publishes ``L2_KEYS_EVICTED`` (``num_bytes`` 0: the size is gone with the key), one event
    per burst of notifications, from its own daemon thread. ``close()`` stops it.

    ``where`` names the server in log lines (a cluster watcher names the node)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        key_prefix: str,
        backend: str,
        bus: EventSink,
        retry_s: float = 1.0,
        where: str = "Redis L2",
    ) -> None:
        self._client = client
        self._where = where
        self._prefix = key_prefix.encode()
        self._backend = backend
        self._bus = bus
        self._retry_s = retry_s
        db = int(client.connection_pool.connection_kwargs.get("db", 0))
        self._channels = [f"__keyevent@{db}__:expired", f"__keyevent@{db}__:evicted"]
        self._halt = threading.Event()
        self._down = False
        self._recheck = False  # check the setting again at the next subscription
        self.state = self._switch_on()
        self._pubsub: Any = None
        self._subscribe()  # first subscription here: events from now on are not missed
        self._thread = threading.Thread(target=self._run, name=f"kvcache-evictions {where}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._halt.set()
        self._thread.join(5)
        self._drop_pubsub()

    # -- internals ------------------------------------------------------------------------
    def _switch_on(self) -> str:
        try:
            reply = self._client.config_get("notify-keyspace-events")
            flags = _text(next(iter(reply.values()), b""))
            if covers(flags):
                return "on"
            wanted = flags.replace("A", _A_ALIAS) + "".join(c for c in NEEDED if c not in flags)
            self._client.config_set("notify-keyspace-events", wanted)
        except redis.RedisError as exc:
            self._recheck = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
            log.warning(
                "%s: cannot read or set notify-keyspace-events (%s); chunks the server "
                "expires or evicts are reported only if it includes %r (set it on the server: "
                "CONFIG SET notify-keyspace-events %s, or in redis.conf)", self._where, exc, NEEDED, NEEDED,
            )  # fmt: skip
            return "unknown"
        log.info(
            "%s: enabled keyspace notifications (%s) to follow expired/evicted chunks", self._where, wanted
        )
        return "enabled"

    def _subscribe(self) -> None:
        try:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(*self._channels)
        except redis.RedisError as exc:
            self._lost(exc)
            return
        self._pubsub = pubsub
        if self._recheck:  # a restarted server forgot a CONFIG SET; one down at start was not asked
            self._recheck = False
            self.state = self._switch_on()
        if self._down:
            self._down = False
            log.info("%s: following expired/evicted chunks again (some may have been missed)", self._where)

    def _run(self) -> None:
        while not self._halt.is_set():
            if self._pubsub is None:
                self._halt.wait(self._retry_s)
                if not self._halt.is_set():
                    self._subscribe()
                continue
            try:
                keys = self._drain()
            except (redis.RedisError, OSError, ValueError) as exc:
                self._drop_pubsub()
                self._lost(exc)
                continue
            if keys:
                meta = L2KeysEvicted(backend=self._backend, keys=keys, num_bytes=0)
                self._bus.publish(Event(EventType.L2_KEYS_EVICTED, meta))

    def _drain(self) -> list[ChunkKey]:
        """The chunk keys of the notifications that arrive within a short wait, and of
        whatever else is already queued behind them."""
        keys: list[ChunkKey] = []
        msg = self._pubsub.get_message(timeout=0.2)
        while msg is not None:
            key = self._chunk_key(msg.get("data"))
            if key is not None:
                keys.append(key)
            msg = self._pubsub.get_message(timeout=0.0)
        return keys

    def _chunk_key(self, name: Any) -> ChunkKey | None:
        if not isinstance(name, bytes) or not name.startswith(self._prefix):
            return None
        digits = name[len(self._prefix) :]
        if len(digits) != _HEX_LEN:
            return None
        try:
            return int(digits, 16)
        except ValueError:
            return None

    def _lost(self, exc: BaseException) -> None:
        self._recheck = True
        if not self._down:
            self._down = True
            log.warning("%s: lost the keyspace notification feed (%s); retrying", self._where, exc)

    def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["NEEDED", "RedisEvictionWatcher", "covers"]
