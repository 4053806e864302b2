"""Redis/Valkey L2 on one server: chunks shared by several machines, one string value per chunk.

Its own module so redis-py is imported only when a Redis tier is configured. Every redis-py
error is translated here (``storage_failure``, also used by the cluster tier) into a
``StorageError`` tagged ``timeout``/``unavailable``/``full``/``busy``/``io`` so the engine can
back off and keep serving from L1; records use the same header + CRC as the disk tier
(``codec``), so a value truncated by ``maxmemory`` games or written by another build is a miss,
never garbage; given a ``RecordSeal`` (``seal``), every record is also sealed with the fleet's
key, and one that is not (written by anyone else who can write to the Redis) is a miss too.
Batches go in one pipelined round trip (``max_batch`` chunks).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import redis
import torch
from redis import exceptions as rex

from kvcache.errors import CorruptChunkError, StorageError
from kvcache.observability.event import EventSink, NullEventBus
from kvcache.records import ChunkKey
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import Announce, L2Adapter, LoadItem, StoreItem, storage_error
from kvcache.storage.l2.redis.notify import RedisEvictionWatcher
from kvcache.storage.l2.redis.seal import RecordSeal, unverified
from kvcache.storage.l2.redis.url import redact

#: Chunks per pipelined batch: a prompt of 16 chunks (4k tokens at 256) goes in one round trip.
DEFAULT_MAX_BATCH = 16


class PipelinedChunks(L2Adapter):
    """What the one-server and the cluster tier share: one key per chunk (``chunk_name``),
    values in the record format, batches as one pipelined ``SET``/``GET``/``EXISTS`` per item.

    A tier supplies ``_run`` (per command the reply or a tagged ``StorageError``: a failure
    fails only its own commands) and ``_drop_corrupt`` (delete records that failed their
    checks; a failed delete leaves a miss that the next load finds corrupt again).
    """

    keeps_meta = True  # another daemon that loads the chunk announces it as its writer did
    key_prefix: str
    ttl_s: int | None
    seal: RecordSeal | None = None
    """Seals written records and refuses unsealed ones; None: every writer is trusted."""

    @abstractmethod
    def _run(self, op: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]: ...

    @abstractmethod
    def _drop_corrupt(self, keys: list[ChunkKey]) -> None: ...

    def _name(self, key: ChunkKey) -> bytes:
        return chunk_name(self.key_prefix, key)

    def store(self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        return unwrap(self.store_many([(key, chunk, announce)]))

    def load(self, key: ChunkKey, out: torch.Tensor) -> bool:
        return unwrap(self.load_many([(key, out)]))

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [unwrap([r]) for r in self.contains_many(keys)]

    def store_many(self, items: Sequence[StoreItem]) -> list[int | Exception]:
        return self.store_many_with_meta(items, [b""] * len(items))

    def store_many_with_meta(
        self, items: Sequence[StoreItem], metas: Sequence[bytes], tenants: Sequence[str] = ()
    ) -> list[int | Exception]:
        # ``tenants`` is not kept: the server evicts by itself, and no principal's name goes
        # to a store other daemons read.
        values = [
            encode_or_error(key, chunk, meta, self.seal, self._name(key))
            for (key, chunk, _), meta in zip(items, metas, strict=True)
        ]
        ex = ("EX", self.ttl_s) if self.ttl_s else ()
        commands = [
            ("SET", self._name(key), v, *ex)
            for (key, _, _), v in zip(items, values, strict=True)
            if not isinstance(v, Exception)
        ]
        replies = iter(self._run("store", commands))
        out: list[int | Exception] = []
        for (_, _, announce), value in zip(items, values, strict=True):
            out.append(value if isinstance(value, Exception) else stored(next(replies), value, announce))
        return out

    def load_many(self, items: Sequence[LoadItem]) -> list[bool | Exception]:
        return self.load_many_with_meta(items)[0]

    def load_many_with_meta(self, items: Sequence[LoadItem]) -> tuple[list[bool | Exception], list[bytes]]:
        names = [self._name(key) for key, _ in items]
        replies = self._run("load", [("GET", name) for name in names])
        out, metas = decoded_all(items, replies, self.seal, names)
        corrupt = [key for (key, _), r in zip(items, out, strict=True) if isinstance(r, CorruptChunkError)]
        if corrupt:
            self._drop_corrupt(corrupt)
        return out, metas

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool | Exception]:
        replies = self._run("contains", [("EXISTS", self._name(key)) for key in keys])
        return [r if isinstance(r, Exception) else bool(r) for r in replies]


class RedisL2Adapter(PipelinedChunks):
    """Values ``<prefix><32 hex digits of the key>`` = header + payload."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvcache:",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
        ttl_s: int | None = None,
        max_connections: int = 32,
        max_batch: int = DEFAULT_MAX_BATCH,
        bus: EventSink | None = None,
        seal: RecordSeal | None = None,
    ) -> None:
        self.url = url
        self.seal = seal
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_batch = max_batch
        pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            max_connections=max_connections,
        )
        self._client = redis.Redis(connection_pool=pool)
        # Keys the server drops by itself (TTL, maxmemory) reach the bus as L2_KEYS_EVICTED.
        self._watcher: RedisEvictionWatcher | None = None
        if bus is not None and not isinstance(bus, NullEventBus):
            self._watcher = RedisEvictionWatcher(
                self._client, key_prefix=key_prefix, backend=self.backend, bus=bus
            )

    # -- L2Adapter ------------------------------------------------------------------------
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        try:
            return int(self._client.delete(*(self._name(k) for k in keys)))
        except Exception as exc:
            raise storage_failure(exc, "delete") from exc

    def info(self) -> dict[str, Any]:
        watched = self._watcher.state if self._watcher is not None else "off"
        return {
            "backend": self.backend,
            "url": redact(self.url),
            "key_prefix": self.key_prefix,
            "records_sealed": self.seal is not None,
            "evictions_watched": watched,
        }

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        self._client.close()
        self._client.connection_pool.disconnect()

    # -- internals ------------------------------------------------------------------------
    def _run(self, op: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` in one round trip; per command the reply or a ``StorageError``
        (a lost connection fails every command of the batch)."""
        if not commands:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            return [storage_failure(exc, op)] * len(commands)
        return [storage_failure(r, op) if isinstance(r, Exception) else r for r in replies]

    def _drop_corrupt(self, keys: list[ChunkKey]) -> None:
        # A failed delete leaves it a miss; the next load finds it corrupt again and retries.
        if keys:
            with contextlib.suppress(StorageError):
                self.delete(keys)


# -- shared with the cluster tier ------------------------------------------------------------


def chunk_name(prefix: str, key: ChunkKey) -> bytes:
    """The Redis key of a chunk. No hash tag: CRC16 of the whole name spreads the chunks of
    one prompt over every slot, hence over every shard of a cluster."""
    return f"{prefix}{key:032x}".encode()


def encode_or_error(
    key: ChunkKey, chunk: torch.Tensor, meta: bytes = b"", seal: RecordSeal | None = None, name: bytes = b""
) -> bytes | Exception:
    """The value of ``chunk`` under ``name``: its record (header, ``meta`` if any, payload),
    sealed if ``seal`` is given; or the error that one item fails with."""
    try:
        payload = codec.tensor_bytes(chunk)
        header = codec.encode_header(key, chunk, payload, meta)
        if seal is not None:
            return seal.seal(name, (header, payload))
        return b"".join((header, payload))
    except (ValueError, UnicodeError) as exc:
        return storage_error(f"chunk {key:032x} cannot be encoded: {exc}", "io")


def stored(reply: Any, value: bytes, announce: Announce | None) -> int | Exception:
    """The outcome of one SET: its error, or the bytes written (announced first)."""
    if isinstance(reply, Exception):
        return reply
    if announce is not None:
        announce(len(value))
    return len(value)


def decoded(
    reply: Any, key: ChunkKey, out: torch.Tensor, seal: RecordSeal | None = None, name: bytes = b""
) -> tuple[bool | Exception, bytes]:
    """The outcome of one GET of ``name``: a miss, its error, ``CorruptChunkError`` (its
    subclass ``ForgedRecordError`` if ``seal`` is given and the value is not sealed with it
    under ``name``), or ``out`` filled; and the record's meta (``b""`` unless filled; also when
    only the meta fails its CRC: the chunk's bytes are still good, only how it was announced
    is lost)."""
    if reply is None or isinstance(reply, Exception):
        return (False if reply is None else reply), b""
    try:
        value = memoryview(reply)
        data = unverified(value)
        header = codec.decode_header(data)
        codec.check_fits(header, key, out)  # first: a value of the wrong size costs no hashing
        if seal is not None:
            data = seal.open(name, value)  # nothing of it is used unless this passes
        payload = data[header.header_len :]
        codec.check_payload(header, payload)
    except CorruptChunkError as exc:
        return exc, b""
    codec.out_buffer(out)[:] = payload
    try:
        return True, codec.decode_meta(data, header)
    except CorruptChunkError:
        return True, b""


def decoded_all(
    items: Sequence[LoadItem], replies: Sequence[Any], seal: RecordSeal | None, names: Sequence[bytes]
) -> tuple[list[bool | Exception], list[bytes]]:
    """``decoded`` for each GET reply of a batch (of ``names``): the outcomes, and the metas."""
    out: list[bool | Exception] = []
    metas: list[bytes] = []
    for (key, tensor), reply, name in zip(items, replies, names, strict=True):
        result, meta = decoded(reply, key, tensor, seal, name)
        out.append(result)
        metas.append(meta)
    return out, metas


def unwrap(results: Sequence[Any]) -> Any:
    """The one result of a single-item batch, raised if it is an error."""
    (result,) = results
    if isinstance(result, Exception):
        raise result
    return result


def failure_reason_of(exc: BaseException) -> str:
    """The ``base.REASONS`` entry for a redis-py error."""
    if isinstance(exc, rex.TimeoutError):
        return "timeout"
    if isinstance(exc, rex.OutOfMemoryError):
        return "full"  # maxmemory reached under the noeviction policy
    if isinstance(exc, rex.MaxConnectionsError):
        return "busy"
    if isinstance(
        exc,
        (
            rex.ConnectionError,  # refused, reset, auth, loading
            rex.ClusterDownError,  # CLUSTERDOWN: slots not served (a shard lost, no replica)
            rex.TryAgainError,  # a slot in migration
            rex.ReadOnlyError,  # a write reached a master just demoted to replica
            rex.RedisClusterException,  # no node answers, slot not covered
        ),
    ):
        return "unavailable"
    return "io"


def storage_failure(exc: BaseException, op: str, scope: str = "tier", where: str = "redis") -> StorageError:
    """``exc`` as a tagged ``StorageError`` (a ``StorageError`` is returned as it is)."""
    if isinstance(exc, StorageError):
        return exc
    reason = failure_reason_of(exc)
    err = storage_error(f"{where} {op} failed ({reason}): {type(exc).__name__}: {exc}", reason, scope)
    err.__cause__ = exc
    return err


__all__ = [
    "DEFAULT_MAX_BATCH",
    "PipelinedChunks",
    "RedisL2Adapter",
    "chunk_name",
    "decoded",
    "decoded_all",
    "encode_or_error",
    "failure_reason_of",
    "storage_failure",
    "stored",
    "unwrap",
]
