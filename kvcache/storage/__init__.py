"""Storage tiers: the L1 CPU pool and the L2 adapters (disk, Redis) behind one interface."""

from kvcache.storage.l1.pool import L1Entry, L1Pool, SlotShape
from kvcache.storage.l2.base import EvictionPolicy, L2Adapter

__all__ = ["EvictionPolicy", "L1Entry", "L1Pool", "L2Adapter", "SlotShape"]
