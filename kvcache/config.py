"""Engine configuration: one frozen record, validated when it is built.

Separate from the engine so that the daemon, the CLI and tests can build, compare and print a
configuration without touching memory or sockets; a bad value fails here, with the field named,
rather than deep inside a store.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvcache.errors import ConfigError  # re-exported: its public home before kvcache.errors

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the ``CacheEngine`` needs to know; all sizes in bytes, all times in seconds.

    L1 is always on. L2 tiers are on when configured: ``l2_disk_path`` (a directory) and/or
    ``l2_redis_url``. With both, stores are written through to both and lookups ask disk first.
    """

    chunk_size: int = 256
    """Tokens per chunk: the unit of hashing, storage and transfer (a multiple of block size)."""
    l1_size_bytes: int = 2 * GiB
    """Capacity of the CPU pool; allocated lazily, extent by extent."""
    l1_evict_watermark: float = 0.9
    """After a store, LRU entries are evicted until usage is at most this fraction of capacity."""
    l1_extent_bytes: int = 64 * MiB
    """Growth step of the pool (rounded to whole chunk slots, at least one slot, and at most a
    quarter of ``l1_size_bytes`` so several chunk geometries can share a small pool)."""
    l1_pin_memory: bool | None = None
    """Pin L1 memory (page-locked). None = pin exactly when CUDA is available (needs a driver)."""
    l2_disk_path: str | None = None
    """Directory of the disk tier; None = no disk tier."""
    l2_disk_size_bytes: int = 16 * GiB
    """Bound of the disk tier; least recently used files are deleted beyond it."""
    l2_redis_url: str | None = None
    """``redis://host:port/db`` (or ``rediss://``, ``unix://``) for one server,
    ``redis+cluster://host:port,host:port,...`` for a Redis / Valkey Cluster (docs/cluster.md);
    None = no Redis tier. Checked by ``kvcache.storage.l2.redis.url.parse_redis_url``."""
    l2_redis_key_prefix: str = "kvcache:"
    l2_redis_auth_key_file: str | None = None
    """File with the secret that seals Redis records (``storage.l2.redis.seal``): only records
    sealed with it are served. None = every writer of the Redis is trusted (docs/cluster.md)."""
    l2_redis_socket_timeout_s: float = 1.0
    l2_redis_connect_timeout_s: float = 1.0
    l2_redis_ttl_s: int | None = None
    """Expiry of Redis entries; None = rely on the server's maxmemory policy."""
    l2_max_inflight: int = 64
    """Bound on queued + running L2 operations per direction; beyond it a write waits (see
    ``store_wait_timeout_s``), then is dropped (an ``L2_STORE_FAILED`` with reason ``"busy"``),
    and a prefetch stops early."""
    l2_workers: int = 4
    """I/O threads per L2 tier."""
    l2_retry_interval_s: float = 5.0
    """After an L2 tier fails with a connection error it is skipped (a miss) for this long."""
    retrieve_wait_timeout_s: float = 30.0
    """How long ``retrieve`` waits for a prefetch still running; then the prefix ends there."""
    lookup_wait_timeout_s: float = 0.1
    """How long a lookup may wait for L1 room to load its L2 chunks into, when every free slot
    is held by loads (or writes) still in flight, e.g. the previous lookups' prefetches. Past
    it the prefix ends there (a smaller hit, never a wrong one). 0 = never wait."""
    store_wait_timeout_s: float = 5.0
    """How long one store may wait, in all, for L1 room held by chunks still being written
    through to L2 (or read by retrieves), and for a place in a busy L2 tier's queue. Under
    pressure stores slow down instead of losing chunks; only past this bound is a chunk
    dropped, reported in ``failed_chunks`` and counted. 0 = never wait."""
    max_report_records: int = 4096
    """Records one ``report_block_allocations`` call may carry (about one per request the
    serving engine scheduled in that step); a larger report is refused whole, since every
    record becomes lifecycle state."""

    def __post_init__(self) -> None:
        _positive_int(self, "chunk_size")
        _positive_int(self, "l1_size_bytes")
        _positive_int(self, "l1_extent_bytes")
        _positive_int(self, "l2_disk_size_bytes")
        _positive_int(self, "l2_max_inflight")
        _positive_int(self, "l2_workers")
        _positive_int(self, "max_report_records")
        w = self.l1_evict_watermark
        if not isinstance(w, (int, float)) or not (0.0 < w <= 1.0) or math.isnan(w):
            raise ConfigError(f"l1_evict_watermark must be in (0, 1], got {w!r}")
        for name in (
            "l2_redis_socket_timeout_s",
            "l2_redis_connect_timeout_s",
            "l2_retry_interval_s",
            "retrieve_wait_timeout_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ConfigError(f"{name} must be a positive finite number, got {v!r}")
        for name in ("store_wait_timeout_s", "lookup_wait_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.l2_redis_ttl_s is not None:
            _positive_int(self, "l2_redis_ttl_s")
        if self.l2_disk_path is not None and (
            not isinstance(self.l2_disk_path, str) or not self.l2_disk_path
        ):
            raise ConfigError(f"l2_disk_path must be a non-empty path, got {self.l2_disk_path!r}")
        if self.l2_redis_url is not None:
            # Imported here, not above: a config record should not load the storage package
            # (the L1 pool, msgspec) just to be built or compared.
            from kvcache.storage.l2.redis.url import parse_redis_url

            parse_redis_url(self.l2_redis_url)  # raises RedisURLError, a ConfigError

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive_int(cfg: EngineConfig, name: str) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


__all__ = ["ConfigError", "EngineConfig"]
