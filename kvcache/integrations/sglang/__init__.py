"""kvcache as an SGLang HiCache storage backend (docs/sglang.md).

Launch SGLang with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang.backend",
"class_name": "KVCacheStorage", "interface_v1": 1, ...}``. The backend class imports SGLang, so
it lives in ``backend`` and is loaded on first attribute access here: the host-pool views, key
packing and configuration stay importable (and testable) without SGLang.
"""

from __future__ import annotations

from typing import Any

from kvcache.integrations.sglang.config import StorageConfig

__all__ = ["KVCacheStorage", "StorageConfig"]


def __getattr__(name: str) -> Any:
    if name == "KVCacheStorage":
        from kvcache.integrations.sglang.backend import KVCacheStorage

        return KVCacheStorage
    raise AttributeError(name)
