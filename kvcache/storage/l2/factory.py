"""Pick storage implementations by name, importing only the ones used.

A lazy registry keeps ``import kvcache`` free of redis-py and of every tier nobody configured;
registering a name twice is refused so two plug-ins cannot silently shadow each other.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Generic, TypeVar

from kvcache.config import EngineConfig
from kvcache.observability.event import EventSink
from kvcache.storage.admission import AdmissionPolicy, create_admission
from kvcache.storage.l2.base import EvictionPolicy, L2Adapter
from kvcache.storage.l2.redis.url import parse_redis_url

T = TypeVar("T")


class _Registry(Generic[T]):
    """Name -> (module, class) with lazy import."""

    def __init__(self, kind: str, base: type[Any]) -> None:
        self._kind = kind
        self._base = base
        self._entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module: str, cls: str) -> None:
        if name in self._entries:
            raise ValueError(f"{self._kind} {name!r} is already registered")
        self._entries[name] = (module, cls)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def load(self, name: str) -> type[T]:
        try:
            module, cls = self._entries[name]
        except KeyError:
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self._kind} {name!r} (known: {known})") from None
        obj = getattr(importlib.import_module(module), cls)
        if not (isinstance(obj, type) and issubclass(obj, self._base)):
            raise TypeError(f"{module}.{cls} is not a {self._base.__name__}")
        return obj

    def create(self, name: str, **kwargs: Any) -> T:
        return self.load(name)(**kwargs)


L2_ADAPTERS: _Registry[L2Adapter] = _Registry("L2 adapter", L2Adapter)
L2_ADAPTERS.register("disk", "kvcache.storage.l2.disk", "DiskL2Adapter")
L2_ADAPTERS.register("redis", "kvcache.storage.l2.redis.single", "RedisL2Adapter")
L2_ADAPTERS.register("redis-cluster", "kvcache.storage.l2.redis.cluster", "RedisClusterL2Adapter")

EVICTION_POLICIES: _Registry[EvictionPolicy] = _Registry("eviction policy", EvictionPolicy)
EVICTION_POLICIES.register("lru", "kvcache.storage.l1.lru", "LRUPolicy")
EVICTION_POLICIES.register("s3fifo", "kvcache.storage.l1.s3fifo", "S3FIFOPolicy")


def create_policy(name: str = "lru") -> EvictionPolicy:
    """A fresh eviction policy by name (``EngineConfig.l1_eviction``, ``l2_disk_eviction``)."""
    return EVICTION_POLICIES.create(name)


def admission_for(config: EngineConfig, backend: str) -> AdmissionPolicy:
    """The admission policy ``config`` names for the tier of ``backend`` (a fresh one per
    tier: each counts its own sightings)."""
    name = config.l2_disk_admission if backend == "disk" else config.l2_redis_admission
    return create_admission(name, config.l2_admission_window)


def l2_adapters_from_config(config: EngineConfig, bus: EventSink) -> list[L2Adapter]:
    """The configured L2 tiers in lookup order (disk, then Redis: one server or a cluster,
    as the URL's scheme says)."""
    tiers: list[L2Adapter] = []
    if config.l2_disk_path is not None:
        tiers.append(
            L2_ADAPTERS.create(
                "disk",
                path=config.l2_disk_path,
                size_bytes=config.l2_disk_size_bytes,
                bus=bus,
                policy=functools.partial(create_policy, config.l2_disk_eviction),  # one per tenant
            )
        )
    if config.l2_redis_url is not None:
        options: dict[str, Any] = {
            "url": config.l2_redis_url,
            "key_prefix": config.l2_redis_key_prefix,
            "socket_timeout_s": config.l2_redis_socket_timeout_s,
            "connect_timeout_s": config.l2_redis_connect_timeout_s,
            "ttl_s": config.l2_redis_ttl_s,
            "seal": None,
        }
        if config.l2_redis_auth_key_file is not None:
            from kvcache.storage.l2.redis.seal import RecordSeal

            options["seal"] = RecordSeal.from_file(config.l2_redis_auth_key_file)
        # Both also report what the servers expire or evict by themselves.
        if parse_redis_url(config.l2_redis_url).cluster:
            # A dead shard fails fast for as long as a dead tier is skipped.
            options["shard_retry_s"] = config.l2_retry_interval_s
            tiers.append(L2_ADAPTERS.create("redis-cluster", bus=bus, **options))
        else:
            tiers.append(L2_ADAPTERS.create("redis", bus=bus, **options))
    return tiers


__all__ = ["EVICTION_POLICIES", "L2_ADAPTERS", "admission_for", "create_policy", "l2_adapters_from_config"]
