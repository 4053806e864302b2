"""A tier shared out between tenants: room is taken from the tenant that holds the most of it.

Why: L1 and the disk tier are each one store for every principal of a daemon. Under one
eviction order for all, a tenant that stores fresh prompts as fast as it can (a flood, or only
a busier engine) pushes every other tenant's prefixes out, and their hits turn into misses
(an L1 miss into an L2 read or a recompute, a disk miss into a recompute): one party slows
another without ever queueing ahead of it. So each tenant's chunks keep an order of their own
(the configured policy, one instance per tenant), and the chunk evicted for room is the next
one of the tenant holding the most bytes, and never one of a tenant holding less than the one
asking (max-min fairness). That holds for every eviction on a tenant's behalf: room for its
write, and (L1) the pass down to the watermark after it (which stops at an equal share:
another tenant's pinned writes holding L1 above the watermark are not the writer's to pay
for). A tenant that holds less than an equal share (what the tier keeps, L1 up to its
watermark, over the tenants holding chunks) loses nothing to the others' stores; a tenant
alone may fill the whole tier.
A writer waits only for pins that could give it room (on chunks of tenants it may take from),
and never for its own (a store's fresh slots, a retrieve's pinned prefix and its loads), which
cannot go while it waits: it fails at once where no other pin could give room. One module for
both tiers so the rule is written once.

What it costs: a tenant cannot grow past an equal share while others hold theirs, so with
several tenants a prompt longer than that no longer fits L1 whole (its tail fails, or, with
an L2 tier, it evicts its own head; a retrieve of it from L2 returns the prefix that fits),
nor the disk tier (it evicts its own head there too); a tenant that went idle keeps its share
until others need more than theirs and it is the fullest.

A chunk counts against the tenant that brought it into the tier (L1: its store, or the
prefetch that loaded it; disk: the write, a store's or a hit's promotion, or after a restart
the tenant its file names) for as long as it stays. Another tenant reading it (a prefix shared
under the same salt) or writing it again neither takes it over nor pays for it: its reads
still order it within its owner's policy. In L1 chunks count whether or not they are evictable
(pinned, being written), since they hold memory all the same; only evictable ones can be
chosen. A disk file is whole and evictable from the moment it is indexed (``charge`` with
``pinned=False``), so the disk tier never pins.

With one tenant (library use, one engine, every client of the daemon's own user) it is the
configured policy, call for call (a tenant's policy outlives its last chunk, so S3-FIFO's
ghost still counts). Choosing a victim sorts the tenants holding chunks: a few microseconds
per eviction with tens of tenants. Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvcache.records import ChunkKey
from kvcache.storage.l2.base import EvictionPolicy


class TenantShares(EvictionPolicy):
    """One eviction policy per tenant; ``victim_for`` is the next victim for a tenant's write.

    The tier reports each slot or file it hands out (``charge``: in L1 born pinned) and takes
    back (``release``), and each L1 entry's first pin and last unpin (``pinned``); the policy
    calls (``add``, ``touch``, ``discard``) are routed by the key's tenant. A tenant's policy
    outlives its last chunk (S3-FIFO's ghost keeps counting its keys), one per tenant ever seen."""

    def __init__(self, make_policy: Callable[[], EvictionPolicy]) -> None:
        self._make_policy = make_policy
        self._policies: dict[str, EvictionPolicy] = {}
        self._held: dict[str, int] = {}  # bytes of slots or files, evictable or not; tenants holding any
        self._pins: dict[str, int] = {}  # entries with a pin, per tenant
        self._tenant: dict[ChunkKey, str] = {}

    def charge(self, key: ChunkKey, tenant: str, nbytes: int, pinned: bool = True) -> None:
        """``key`` took ``nbytes`` for ``tenant``: an L1 slot, born pinned (not yet evictable,
        counted until ``pinned(tenant, -1)``), or (``pinned=False``) a disk file, evictable
        once the tier ``add``s it."""
        if tenant not in self._policies:
            self._policies[tenant] = self._make_policy()  # first: a factory that fails changes nothing
        self._tenant[key] = tenant
        self._held[tenant] = self._held.get(tenant, 0) + nbytes
        if pinned:
            self._pins[tenant] = self._pins.get(tenant, 0) + 1

    def release(self, key: ChunkKey, nbytes: int) -> None:
        """``key`` gave its slot or file back (evicted, deleted, or its write failed), unpinned."""
        tenant = self._tenant.pop(key, None)
        if tenant is None:
            return
        left = self._held[tenant] - nbytes
        if left > 0:
            self._held[tenant] = left
        else:
            del self._held[tenant]

    def pinned(self, tenant: str, delta: int) -> None:
        """An entry of ``tenant`` took its first pin (+1) or lost its last (-1). By tenant, not
        key: an entry dropped while a reader still pins it (a failed load) is unpinned after
        its key is gone, or charged again to a new entry."""
        self._pins[tenant] += delta

    def pinned_total(self) -> int:
        """Entries with a pin, every tenant's."""
        return sum(self._pins.values())

    def held(self) -> dict[str, int]:
        """Bytes of the tier each tenant holding any is charged for."""
        return dict(self._held)

    def _takers(self, tenant: str | None, adding: int = 0) -> list[str]:
        """The tenants ``tenant`` may take room from, fullest first (itself first among
        equals): those holding at least as much as it does (with ``adding`` bytes more)."""
        held = self._held
        floor = held.get(tenant, 0) + adding if tenant is not None else 0
        counted = ((n + adding if name == tenant else n, name == tenant, name) for name, n in held.items())
        order = sorted(c for c in counted if c[0] >= floor)
        return [name for _, _, name in reversed(order)]

    def victim_for(
        self, tenant: str | None, first: str | None = None, adding: int = 0
    ) -> tuple[ChunkKey | None, str | None]:
        """The next victim when ``tenant`` needs room, and whose it is: the next chunk of the
        fullest tenant holding at least as much as ``tenant`` (``tenant`` first among equals,
        so two tenants holding the same never trade chunks); ``first``'s next chunk, if it has
        one, where an allocation already evicts from ``first`` (its slab frees a whole extent
        for another slot shape only once enough of its chunks left). None when no such
        tenant has an evictable chunk (the asker's own are pinned by its copies in flight):
        a tenant never takes room from one holding less, it waits for its own or goes
        without. ``adding``: bytes ``tenant`` is about to be charged for, when the question
        is asked before the write it is for (the disk tier's admission, which weighs the
        victim that write would evict): it may then take from fewer."""
        if len(self._policies) == 1 and (not adding or tenant in self._policies):
            name = next(iter(self._policies))
            return self._policies[name].victim(), name
        if first is not None and first in self._held and (key := self._policies[first].victim()) is not None:
            return key, first
        for name in self._takers(tenant, adding):
            key = self._policies[name].victim()
            if key is not None:  # the fullest tenant may hold only pinned chunks just now
                return key, name
        return None, None

    def over_share(self, tenant: str | None, limit: float) -> bool:
        """Whether ``tenant`` holds more than an equal share of ``limit`` bytes (alone, any
        byte over it)."""
        held = self._held
        return tenant is not None and held.get(tenant, 0) * len(held) > limit

    def room_may_come(self, tenant: str | None, mine: int | Mapping[str, int]) -> bool:
        """Whether a pin that, once gone, could give ``tenant`` room is held: one on a chunk
        of a tenant it may take from, other than those the asker holds itself, which never go
        while it waits. ``mine``: the asker's pinned entries, a count on ``tenant``'s own (a
        write reservation's fresh slots) or a count per owner (a retrieve's pinned prefix,
        which may hold chunks another tenant brought in under a shared salt)."""
        pins, takers = self._pins, self._takers(tenant)
        if isinstance(mine, int):
            return any(pins.get(name, 0) - (mine if name == tenant else 0) > 0 for name in takers)
        return any(pins.get(name, 0) - mine.get(name, 0) > 0 for name in takers)

    def victim(self) -> ChunkKey | None:
        """The fullest tenant's next victim (the pool asks ``victim_for`` on a tenant's behalf)."""
        return self.victim_for(None)[0]

    # -- EvictionPolicy -------------------------------------------------------------------
    def add(self, key: ChunkKey) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._policies[tenant].add(key)

    def touch(self, key: ChunkKey) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._policies[tenant].touch(key)

    def touch_many(self, keys: Iterable[ChunkKey]) -> None:
        if len(self._policies) == 1:
            next(iter(self._policies.values())).touch_many(keys)
            return
        by_tenant: dict[str, list[ChunkKey]] = {}
        tenant_of = self._tenant.get
        for key in keys:  # each tenant's keys keep their order: only that order matters
            tenant = tenant_of(key)
            if tenant is not None:
                by_tenant.setdefault(tenant, []).append(key)
        for tenant, group in by_tenant.items():
            self._policies[tenant].touch_many(group)

    def discard(self, key: ChunkKey) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._policies[tenant].discard(key)

    def __len__(self) -> int:
        return sum(len(p) for p in self._policies.values())

    def __contains__(self, key: object) -> bool:
        tenant = self._tenant.get(key)  # type: ignore[call-overload]
        return tenant is not None and key in self._policies[tenant]


__all__ = ["TenantShares"]
