"""Storage tiers: the L1 CPU pool and the L2 adapters (disk, Redis) behind one interface."""

from kvcache.storage.base import EvictionPolicy, L2Adapter
from kvcache.storage.l1_pool import L1Entry, L1Pool, SlotGeometry

__all__ = ["EvictionPolicy", "L1Entry", "L1Pool", "L2Adapter", "SlotGeometry"]
