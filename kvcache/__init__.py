"""kvcache: a KV-cache offload engine for LLM serving.

``import kvcache`` stays light (torch and the native module only): the transfer core is
importable on a machine without the daemon's or the observability side's dependencies.
"""

import contextlib
from typing import Any

from kvcache.context import CacheContext
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    CorruptChunkError,
    CudaUnavailableError,
    DaemonUnavailableError,
    KvcacheError,
    LayoutError,
    ProtocolError,
    StorageError,
    UnknownInstanceError,
)
from kvcache.geometry import Geometry
from kvcache.layouts import KVFormat, detect_format

__version__ = "0.1.0"

# Heavier pieces (msgspec, storage tiers) load on first use, so the transfer core keeps
# working on machines that have only torch and the native module.
_LAZY = {
    "CacheEngine": "kvcache.engine.engine",
    "RetrieveResult": "kvcache.records",
    "StoreResult": "kvcache.records",
    "RetrieveRequest": "kvcache.request",
    "StoreRequest": "kvcache.request",
    "KeyScope": "kvcache.keys",
    "Deadline": "kvcache.deadline",
    "EngineConfig": "kvcache.config",
    "OffloadStats": "kvcache.engine.stats",
    "KVCacheClient": "kvcache.client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockIdError",
    "CacheContext",
    "CacheEngine",
    "ChunkMismatchError",
    "CorruptChunkError",
    "CudaUnavailableError",
    "DaemonUnavailableError",
    "Deadline",
    "EngineConfig",
    "Geometry",
    "KVCacheClient",
    "KVFormat",
    "KeyScope",
    "KvcacheError",
    "LayoutError",
    "OffloadStats",
    "ProtocolError",
    "RetrieveRequest",
    "RetrieveResult",
    "StorageError",
    "StoreRequest",
    "StoreResult",
    "UnknownInstanceError",
    "__version__",
    "detect_format",
]

for _name in __all__:
    if _name in _LAZY:
        continue
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and not isinstance(_obj, str):
        with contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = "kvcache"
