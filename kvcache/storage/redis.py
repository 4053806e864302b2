"""Redis/Valkey L2: chunks shared by several machines, one string value per chunk.

Its own module so redis-py is imported only when a Redis tier is configured. Every redis-py
error is translated here into a ``StorageError`` tagged ``timeout``/``unavailable``/``io`` so the
engine can back off and keep serving from L1; records use the same header + CRC as the disk
tier (``codec``), so a value truncated by ``maxmemory`` games or written by another build is a
miss, never garbage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import torch

from kvcache.errors import CorruptChunkError
from kvcache.observability.event import ChunkKey
from kvcache.storage import codec
from kvcache.storage.base import Announce, L2Adapter, storage_error


class RedisL2Adapter(L2Adapter):
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
    ) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            max_connections=max_connections,
        )
        self._client = redis.Redis(connection_pool=pool)

    def _name(self, key: ChunkKey) -> bytes:
        return f"{self.key_prefix}{key:032x}".encode()

    # -- L2Adapter ------------------------------------------------------------------------
    def store(self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        payload = codec.tensor_bytes(chunk)
        value = codec.encode_header(key, chunk, payload) + payload.tobytes()
        with _translated("store"):
            self._client.set(self._name(key), value, ex=self.ttl_s)
        if announce is not None:
            announce(len(value))
        return len(value)

    def load(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with _translated("load"):
            value = self._client.get(self._name(key))
        if value is None:
            return False
        try:
            data = memoryview(value)  # type: ignore[arg-type]
            header = codec.decode_header(data)
            codec.check_fits(header, key, out)
            payload = data[header.header_len :]
            codec.check_payload(header, payload)
        except CorruptChunkError:
            self.delete([key])
            raise
        codec.out_buffer(out)[:] = payload
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        with _translated("contains"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        with _translated("delete"):
            return int(self._client.delete(*(self._name(k) for k in keys)))

    def info(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": _redact(self.url), "key_prefix": self.key_prefix}

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()


@contextlib.contextmanager
def _translated(op: str) -> Iterator[None]:
    """redis-py errors -> ``StorageError`` tagged with a reason (``base.REASONS``)."""
    try:
        yield
    except redis.TimeoutError as exc:
        raise storage_error(f"redis {op} timed out: {exc}", "timeout") from exc
    except redis.ConnectionError as exc:
        raise storage_error(f"redis {op}: server unavailable: {exc}", "unavailable") from exc
    except redis.RedisError as exc:
        raise storage_error(f"redis {op} failed: {exc}", "io") from exc


def _redact(url: str) -> str:
    """Hide a password in ``redis://user:pass@host``."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


__all__ = ["RedisL2Adapter"]
