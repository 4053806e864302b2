"""Storage tiers: the L1 CPU pool and the L2 adapters (disk, Redis) behind one interface."""

from typing import TYPE_CHECKING

from kvcache.deprecated import renamed
from kvcache.storage.l1.pool import L1Entry, L1Pool, SlotShape
from kvcache.storage.l2.base import EvictionPolicy, L2Adapter

if TYPE_CHECKING:
    SlotGeometry = SlotShape  # deprecated: the runtime alias below warns
else:
    __getattr__ = renamed(__name__, {"SlotGeometry": "SlotShape"})

__all__ = ["EvictionPolicy", "L1Entry", "L1Pool", "L2Adapter", "SlotShape"]
