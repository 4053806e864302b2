"""The parts the engine's data paths share: config, L1 pool, L2 tiers, statistics, events,
the waiters (stores wait for L1 room, retrieves for L2 loads), the signal loads settle on and
the alarms that bound waits made by callback.

Separate so the facade builds them once and the store and retrieve paths take one record, instead
of each path repeating the same constructor (and drifting apart in what it is handed).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from kvcache.config import EngineConfig
from kvcache.engine.alarms import Alarms
from kvcache.engine.op_events import OpEvents
from kvcache.engine.stats import OffloadStatsCollector
from kvcache.engine.waiter import Waiter
from kvcache.engine.waiting import WaitingRetrieves, notify_settled
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
    alarms: Alarms

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        pool: L1Pool,
        tiers: list[AsyncL2],
        stats: OffloadStatsCollector,
        events: OpEvents,
    ) -> EngineParts:
        """The parts around the given storage: the waiters, what they wake on, the alarms."""
        settled = threading.Condition()
        store_waiter = Waiter(pool.wake_writers, "kvcache-store-wait")
        retrieve_waiter = Waiter(
            functools.partial(notify_settled, settled), "kvcache-retrieve-wait", wake_on_add=True
        )
        waiting = WaitingRetrieves(settled)
        alarms = Alarms("kvcache-alarms")
        waiters = (store_waiter, retrieve_waiter)
        return cls(config, pool, tiers, stats, events, *waiters, settled, waiting, alarms)


__all__ = ["EngineParts"]
