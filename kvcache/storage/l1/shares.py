"""L1 shared out between tenants: room is taken from the tenant that holds the most of it.

Why: L1 is one pool for every principal of a daemon. Under one eviction order for all, a
tenant that stores fresh prompts as fast as it can (a flood, or only a busier engine) pushes
every other tenant's prefixes out, and their L1 hits turn into L2 reads or recomputes: one
party slows another without ever queueing ahead of it. So each tenant's chunks keep an order
of their own (the configured policy, one instance per tenant), and the chunk evicted for room
is the next one of the tenant holding the most bytes, and never one of a tenant holding less
than the one asking (max-min fairness). A tenant that holds no more than an equal share (L1's
capacity over the tenants holding chunks) loses nothing to the others' stores; a tenant alone
may fill the whole pool.

A chunk counts against the tenant that brought it into L1 (its store, or the prefetch that
loaded it) for as long as it stays. Another tenant reading it (a prefix shared under the same
salt) neither takes it over nor pays for it: its reads still order it within its owner's
policy. Chunks count whether or not they are evictable (pinned, being written), since they
hold memory all the same; only evictable ones can be chosen.

With one tenant (library use, one engine, every client of the daemon's own user) it is the
configured policy, call for call. Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvcache.records import ChunkKey
from kvcache.storage.l2.base import EvictionPolicy


class TenantShares(EvictionPolicy):
    """One eviction policy per tenant; ``victim`` is the fullest tenant's next victim.

    The pool reports each slot it hands out (``charge``) and takes back (``release``); the
    policy calls (``add``, ``touch``, ``discard``) are routed by the key's tenant."""

    def __init__(self, make_policy: Callable[[], EvictionPolicy]) -> None:
        self._make_policy = make_policy
        self._policies: dict[str, EvictionPolicy] = {}
        self._held: dict[str, int] = {}  # bytes of slots, evictable or not
        self._tenant: dict[ChunkKey, str] = {}

    def charge(self, key: ChunkKey, tenant: str, nbytes: int) -> None:
        """``key`` took a slot of ``nbytes`` for ``tenant`` (not yet evictable)."""
        self._tenant[key] = tenant
        self._held[tenant] = self._held.get(tenant, 0) + nbytes
        if tenant not in self._policies:
            self._policies[tenant] = self._make_policy()

    def release(self, key: ChunkKey, nbytes: int) -> None:
        """``key`` gave its slot back (evicted, deleted, or its write failed)."""
        tenant = self._tenant.pop(key, None)
        if tenant is None:
            return
        left = self._held[tenant] - nbytes
        if left > 0:
            self._held[tenant] = left
            return
        del self._held[tenant]  # a tenant holding nothing leaves no state behind
        del self._policies[tenant]

    def held(self) -> dict[str, int]:
        """Bytes of L1 each tenant holding any is charged for."""
        return dict(self._held)

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

    def victim(self) -> ChunkKey | None:
        return self.victim_for(None)

    def victim_for(self, tenant: str | None) -> ChunkKey | None:
        """The next victim when ``tenant`` needs room: the next chunk of the fullest tenant
        holding at least as much as ``tenant`` (``tenant`` first among equals, so two tenants
        holding the same never trade chunks). None when none of those has an evictable chunk
        (the asker's own are pinned by its copies in flight): a tenant never takes room from
        one holding less, it waits for its own chunks or goes without."""
        if len(self._policies) == 1:
            return next(iter(self._policies.values())).victim()
        held = self._held
        floor = held.get(tenant, 0) if tenant is not None else 0
        for name in sorted(held, key=lambda t: (held[t], t == tenant), reverse=True):
            if held[name] < floor:
                break
            key = self._policies[name].victim()
            if key is not None:  # the fullest tenant may hold only pinned chunks just now
                return key
        return None

    def __len__(self) -> int:
        return sum(len(p) for p in self._policies.values())

    def __contains__(self, key: object) -> bool:
        tenant = self._tenant.get(key)  # type: ignore[call-overload]
        return tenant is not None and key in self._policies[tenant]


__all__ = ["TenantShares"]
