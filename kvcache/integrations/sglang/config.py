"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

Separate from the backend so the keys it accepts, and the scope it derives from SGLang's
storage config (model, tensor-parallel rank, MLA), are in one short file that imports no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Keys SGLang's factory or cache controller read themselves; accepted here and ignored.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "allocator",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})  # fmt: skip


@dataclass(frozen=True)
class StorageConfig:
    """``endpoint``: the daemon (default: the local daemon's Unix socket). ``cache_salt``: the
    tenant namespace every page is keyed under (the daemon checks it against the tenant's
    rules). ``model_name``: overrides SGLang's ``model_name`` in the key scope (two deployments
    of one model that must not share pages pick different names or salts). ``staging_pages``:
    pages per copy batch through the shared staging buffer, per direction (the host pool is
    used in place when it can be). ``timeout_s``: every daemon call. ``daemon_uid``,
    ``curve_server_key``, ``curve_secret_key``: as ``KVCacheClient`` takes them."""

    endpoint: str | None = None
    cache_salt: str = ""
    model_name: str | None = None
    staging_pages: int = 128
    timeout_s: float = 10.0
    daemon_uid: int | None = None
    curve_server_key: str | None = None
    curve_secret_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.staging_pages <= 1 << 16:
            raise ValueError(f"staging_pages must be in [1, 65536], got {self.staging_pages}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> StorageConfig:
        """Our keys from SGLang's extra config; an unknown key is refused (a typo would
        otherwise silently drop, say, the tenant salt)."""
        extra = dict(extra or {})
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in extra if k not in fields and k not in SGLANG_KEYS)
        if unknown:
            raise ValueError(f"unknown kvcache extra-config keys {unknown}; known: {sorted(fields)}")
        return cls(**{k: v for k, v in extra.items() if k in fields})


def scoped_model_name(
    model: str,
    *,
    tp_rank: int,
    tp_size: int,
    is_mla: bool,
    pp_rank: int = 0,
    pp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> str:
    """The model name pages are keyed under: MHA ranks hold different heads, so each rank has
    its own pages; MLA ranks hold the same latent cache and share (rank 0 writes). Pipeline and
    context-parallel shards are always apart."""
    name = f"sglang:{model}" + ("|mla" if is_mla else f"|tp{tp_rank}of{tp_size}")
    if pp_size > 1:
        name += f"|pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        name += f"|cp{cp_rank}of{cp_size}"
    return name


__all__ = ["SGLANG_KEYS", "StorageConfig", "scoped_model_name"]
