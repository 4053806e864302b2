"""kvcache: a KV-cache offload engine for LLM serving.

``import kvcache`` stays light (torch and the native module only): the transfer core is
importable on a machine without the daemon's or the observability side's dependencies.
"""

import contextlib

from kvcache.context import GPUCacheContext
from kvcache.errors import (
    BlockIdError,
    ChunkMismatchError,
    CorruptChunkError,
    CudaUnavailableError,
    KvcacheError,
    LayoutError,
    ProtocolError,
    StorageError,
    UnknownInstanceError,
)
from kvcache.layouts import GPUKVFormat, KVShape, detect_format

__version__ = "0.1.0"

__all__ = [
    "BlockIdError",
    "ChunkMismatchError",
    "CorruptChunkError",
    "CudaUnavailableError",
    "GPUCacheContext",
    "GPUKVFormat",
    "KVShape",
    "KvcacheError",
    "LayoutError",
    "ProtocolError",
    "StorageError",
    "UnknownInstanceError",
    "__version__",
    "detect_format",
]

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and not isinstance(_obj, str):
        with contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = "kvcache"
