"""The parts the engine's data paths share: config, L1 pool, L2 tiers, statistics, events,
the waiters (stores wait for L1 room, retrieves for L2 loads) and the signal loads settle on.

Separate so the facade builds them once and the store and retrieve paths take one record, instead
of each path repeating the same constructor (and drifting apart in what it is handed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvcache.config import EngineConfig
from kvcache.engine.op_events import OpEvents
from kvcache.engine.stats import OffloadStatsCollector
from kvcache.engine.waiter import Waiter
from kvcache.engine.waiting import WaitingRetrieves
from kvcache.storage.l1.pool import L1Pool
from kvcache.storage.l2.async_front import AsyncL2


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What one ``CacheEngine`` owns; its paths share these objects (the same instances).

    ``loads_settled`` is notified after every L2 -> L1 load settled (``retrieve.prefetch``), and
    by ``retrieve_waiter``'s ``wake``: a waiting retrieve waits on it, never on one entry, so
    a stop reaches it at once. ``waiting`` holds the retrieves waiting for loads, guarded by
    ``loads_settled``: whichever retrieve waiter pass is waiting serves them all."""

    config: EngineConfig
    pool: L1Pool
    tiers: list[AsyncL2]
    stats: OffloadStatsCollector
    events: OpEvents
    store_waiter: Waiter
    retrieve_waiter: Waiter
    loads_settled: threading.Condition
    waiting: WaitingRetrieves


__all__ = ["EngineParts"]
