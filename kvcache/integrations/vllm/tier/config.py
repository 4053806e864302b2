"""The tier's settings: the keys of its entry in vLLM's ``secondary_tiers`` list.

Separate from the tier so the keys it accepts are in one short file that imports no vLLM. The
keys follow the SGLang backend's extra config (``integrations/sglang/config.py``): a user who
knows one knows the other.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvcache.errors import ConfigError

LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """``endpoint``: the daemon (default: the local daemon's Unix socket). ``cache_salt``: the
    tenant namespace every chunk is keyed under (the daemon checks it against the tenant's
    rules). ``model_name``: replaces vLLM's model name in the key scope (two deployments of
    one model that must not share chunks pick different names or salts). ``staging_chunks``:
    chunks per copy batch through the staging buffer, per direction. ``timeout_s``: every
    store and load. ``lookup_timeout_s``: how long one lookup round trip may take before its
    chunks count as misses (vLLM's requests wait on a pending lookup, so this is short).
    ``max_pending_stores``: store jobs queued at most; more fail at once (a slow daemon
    costs the tier chunks, never vLLM's steps). ``locality``: ``LOCAL`` or ``REMOTE``, what
    vLLM's per-request tier filters match. ``enable_kv_events``: report stored chunks as
    vLLM KV events (with vLLM's events on). ``daemon_uid``, ``curve_server_key``,
    ``curve_secret_key``: as ``KVCacheClient`` takes them."""

    endpoint: str | None = None
    cache_salt: str = ""
    model_name: str | None = None
    staging_chunks: int = 16
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0
    max_pending_stores: int = 64
    locality: str | None = None
    enable_kv_events: bool = False
    daemon_uid: int | None = None
    curve_server_key: str | None = None
    curve_secret_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.staging_chunks <= 4096:
            raise ConfigError(f"staging_chunks must be in [1, 4096], got {self.staging_chunks}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if not self.lookup_timeout_s > 0:
            raise ConfigError(f"lookup_timeout_s must be positive, got {self.lookup_timeout_s}")
        if self.max_pending_stores < 1:
            raise ConfigError(f"max_pending_stores must be >= 1, got {self.max_pending_stores}")
        if self.locality is not None and self.locality not in LOCALITIES:
            raise ConfigError(f"locality must be one of {LOCALITIES}, got {self.locality!r}")
        if not isinstance(self.enable_kv_events, bool):
            raise ConfigError(f"enable_kv_events takes true or false, got {self.enable_kv_events!r}")
        if not isinstance(self.cache_salt, str):
            raise ConfigError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> TierConfig:
        """Our keys from the tier's config (vLLM's factory has taken ``type``,
        ``module_path`` and ``backpressure`` already); an unknown key is refused, since a
        typo would otherwise silently drop, say, the tenant salt."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(f"unknown KVCacheTier keys {unknown}; known: {sorted(known)}")
        return cls(**extra)


__all__ = ["LOCALITIES", "TierConfig"]
