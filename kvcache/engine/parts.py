"""The parts the engine's data paths share: config, L1 pool, L2 tiers, statistics, events,
and the thread stores wait for L1 room on.

Separate so the facade builds them once and the store and load paths take one record, instead
of each path repeating the same constructor (and drifting apart in what it is handed).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.config import EngineConfig
from kvcache.engine.op_events import OpEvents
from kvcache.engine.stats import OffloadStatsCollector
from kvcache.engine.waiter import StoreWaiter
from kvcache.storage.l1_pool import L1Pool
from kvcache.storage.l2_async import AsyncL2


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What one ``CacheEngine`` owns; its paths share these objects (the same instances)."""

    config: EngineConfig
    pool: L1Pool
    tiers: list[AsyncL2]
    stats: OffloadStatsCollector
    events: OpEvents
    waiter: StoreWaiter


__all__ = ["EngineParts"]
