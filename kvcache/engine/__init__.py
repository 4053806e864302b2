"""The cache engine: the library API over L1/L2 and the offload statistics it keeps."""

from kvcache.engine.engine import CacheEngine, LookupHit, RetrieveResult, StoreResult
from kvcache.engine.stats import OffloadStats, TransferStats

__all__ = ["CacheEngine", "LookupHit", "OffloadStats", "RetrieveResult", "StoreResult", "TransferStats"]
