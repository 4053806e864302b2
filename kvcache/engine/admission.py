"""Where the engine asks each tier's admission policy, and writes what it admits.

Two moments a chunk is sighted, two entries here: a store (``admitted_on_store``: which of the
chunks just stored in L1 each tier takes, so the store path pins and writes only those) and a
read of L1 (``HitPromoter``, the pool's read watcher: a hit that makes a chunk worth writing,
e.g. its second sighting under ``second-hit``, writes it to that tier then). The policies
themselves are ``kvcache.storage.admission``; this module is the engine's side of them, apart
from the store path so that it reads as one rule.

A promoted chunk is written without the ``ChunkIdentity`` meta its store would have kept with
it (a read does not know the tokens): after a restart the disk tier reports it with no identity,
as it does a file written by an older build.

Every write, and every question about the victim it would evict, is on behalf of the chunk's
owner in L1 (``L1Entry.tenant``: the tenant that stored it; a promotion writes a chunk its
store did not, and the reader whose hit promotes it is not its owner): the disk tier is shared
out between tenants (``storage.shares``), so the victim a policy weighs a candidate against is
one of the fullest tenant the writer may take from, not the tier's oldest chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.observability.event import Event, EventSink, EventType, L2StoreDeclined, NullEventBus
from kvcache.storage.admission import AlwaysAdmit
from kvcache.storage.l1.entry import L1Entry
from kvcache.storage.l1.pool import L1Pool
from kvcache.storage.l2.async_front import AsyncL2


def admitted_on_store(tier: AsyncL2, entries: Sequence[L1Entry], bus: EventSink) -> list[L1Entry]:
    """The stored ``entries`` that ``tier`` takes; the others are published in one
    ``L2_STORE_DECLINED`` (the metrics count declined chunks and bytes per backend)."""
    policy = tier.admission
    if isinstance(policy, AlwaysAdmit):
        return list(entries)
    victim_for = tier.adapter.victim_for if policy.uses_victim else _no_victim
    taken: list[L1Entry] = []
    declined: list[L1Entry] = []
    for entry in entries:
        victim = victim_for(entry.nbytes, entry.tenant)  # what this writer's write would evict
        (taken if policy.on_store(entry.key, victim) else declined).append(entry)
    if declined and not isinstance(bus, NullEventBus):
        meta = L2StoreDeclined(
            backend=tier.backend,
            keys=[e.key for e in declined],
            num_bytes=sum(e.nbytes for e in declined),
            policy=policy.name,
        )
        bus.publish(Event(EventType.L2_STORE_DECLINED, meta))
    return taken


def _no_victim(nbytes: int, tenant: str) -> None:
    return None


class HitPromoter:
    """Called by ``L1Pool.release`` with the entries a retrieve read from L1, while they are
    still pinned: each tier whose policy now admits one of them gets it written, pinned once
    more until that write ends (as a store's write-through does).

    Entries loaded from L2 are skipped: they are already in a tier. A tier that is busy past
    ``wait_s`` (0: a retrieve never waits for a promotion) drops the write: a promotion is an
    optimisation, the chunk is still in L1."""

    def __init__(self, pool: L1Pool, tiers: Sequence[AsyncL2]) -> None:
        self._pool = pool
        self._tiers = [t for t in tiers if not isinstance(t.admission, AlwaysAdmit)]

    @property
    def active(self) -> bool:
        """Whether any tier can promote on a hit (else the pool need not call it)."""
        return bool(self._tiers)

    def __call__(self, entries: Sequence[L1Entry]) -> None:
        fresh = [e for e in entries if not e.in_l2]
        if not fresh:
            return
        pool = self._pool
        for tier in self._tiers:
            policy = tier.admission
            victim_for = tier.adapter.victim_for if policy.uses_victim else _no_victim
            chosen = [e for e in fresh if policy.on_hit(e.key, victim_for(e.nbytes, e.tenant))]
            if not chosen:
                continue
            pool.pin(chosen)
            for entry in chosen:

                def done(ok: bool, entry: L1Entry = entry) -> None:
                    pool.release([entry])

                if not tier.submit_store(entry.key, entry.tensor, done, 0.0, tenant=entry.tenant):
                    pool.release([entry])


__all__ = ["HitPromoter", "admitted_on_store"]
