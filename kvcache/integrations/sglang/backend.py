"""``KVCacheStorage``: SGLang's ``HiCacheStorage`` on the kvcache daemon (docs/sglang.md).

SGLang builds it through ``StorageBackendFactory`` (``--hicache-storage-backend dynamic``),
then hands it the host pool (``register_mem_pool_host``); from then on its cache controller
calls, from its own I/O threads: ``batch_exists`` (the leading run of pages held),
``batch_set_v1`` / ``batch_get_v1`` (pages by host index, with ``interface_v1``), or the v2
(``PoolTransfer``) and legacy entry points. Every call is one daemon request per batch of pages
(``staging_pages``), never one per page. A hybrid model's other host pools (Mamba state, ...)
arrive through ``register_mem_host_pool_v2`` and are kept as side pools (``sidecars.py``), each
keyed apart; a prefix is a hit only as far as every pool the caller names restores it.

Keys: SGLang's page hashes (``keys``), scoped on the daemon by model (with the tensor-parallel
rank for MHA: ``config.scoped_model_name``), the page geometry and dtype, and the tenant's
``cache_salt``. MLA: every rank reads the one shared copy; only the storage writer (rank 0)
writes, the others answer a set as done.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvcache.client import KVCacheClient
from kvcache.integrations.sglang.config import StorageConfig, scoped_model_name
from kvcache.integrations.sglang.host import HostPages
from kvcache.integrations.sglang.keys import pack_page_keys
from kvcache.integrations.sglang.sidecars import SidePool
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids

log = logging.getLogger("kvcache.integrations.sglang")


class KVCacheStorage(HiCacheStorage):
    """One SGLang rank's view of the daemon: one registered instance (its host pool, or a
    staging buffer beside it). Thread-safe: daemon calls share the client's socket, and each
    direction's staging half has its own lock."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config = StorageConfig.from_extra(storage_config.extra_config)
        sc = storage_config
        self.is_mla = bool(sc.is_mla_model)
        self.is_writer = bool(sc.is_storage_writer)
        self.model_name = scoped_model_name(
            self.config.model_name or sc.model_name or "model", tp_rank=sc.tp_rank, tp_size=sc.tp_size,
            is_mla=self.is_mla, pp_rank=sc.pp_rank, pp_size=sc.pp_size, cp_rank=sc.attn_cp_rank,
            cp_size=sc.attn_cp_size,
        )  # fmt: skip
        self.side_model_name = scoped_model_name(
            self.config.model_name or sc.model_name or "model", tp_rank=sc.tp_rank, tp_size=sc.tp_size,
            is_mla=False, pp_rank=sc.pp_rank, pp_size=sc.pp_size, cp_rank=sc.attn_cp_rank,
            cp_size=sc.attn_cp_size,
        )  # fmt: skip
        """Side pools (Mamba state, ...) are per rank even for MLA: their state is sharded by
        heads, and every rank writes its own (SGLang's controller picks which transfers reach
        each rank)."""
        self.client: KVCacheClient | None = None
        self.pages: HostPages | None = None
        self.page_size = 0
        self.side_pools: dict[str, SidePool] = {}

    # -- registration ---------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        ps = int(mem_pool_host.page_size)
        pages = HostPages(mem_pool_host.kv_buffer, mem_pool_host.layout, mla=self.is_mla, page_size=ps,
                          staging_pages=self.config.staging_pages)  # fmt: skip
        cfg = self.config
        client = KVCacheClient(
            cfg.endpoint, model_name=self.model_name, timeout_s=cfg.timeout_s, daemon_uid=cfg.daemon_uid,
            curve_server_key=cfg.curve_server_key, curve_secret_key=cfg.curve_secret_key,
        )  # fmt: skip
        try:
            client.register_kv_caches(
                pages.kv_caches, engine="sglang", block_size=ps, fmt=pages.fmt, chunk_size=ps
            )
        except BaseException:
            client.close(unregister=False)
            raise
        self.client, self.pages, self.page_size = client, pages, ps
        log.info(
            "kvcache: %s host pool (%s, %d pages of %d tokens) registered as %s, %s",
            "MLA" if self.is_mla else "MHA", pages.layout, pages.num_pages, ps, self.model_name,
            "in place" if pages.zero_copy else f"staged by {cfg.staging_pages} pages",
        )  # fmt: skip

    def _ready(self) -> tuple[KVCacheClient, HostPages]:
        if self.client is None or self.pages is None:
            raise RuntimeError("KVCacheStorage: register_mem_pool_host has not been called")
        return self.client, self.pages

    def _set(self, client: KVCacheClient, keys: list[str], ids: Any) -> int:
        """One ``PageSet``; the pages now held (stored, or present already)."""
        msg = m.PageSet(
            instance_id=client.instance_id, keys=pack_page_keys(keys), block_ids=pack_ids(ids),
            cache_salt=self.config.cache_salt, deadline_ms=int((time.time() + self.config.timeout_s) * 1000),
        )  # fmt: skip
        reply = client.page_set(msg)
        return int(reply.stored_chunks + reply.skipped_chunks)

    def _get(self, client: KVCacheClient, keys: list[str], ids: Any) -> int:
        """One ``PageGet``; the leading pages copied into ``ids``."""
        msg = m.PageGet(
            instance_id=client.instance_id, keys=pack_page_keys(keys), block_ids=pack_ids(ids),
            cache_salt=self.config.cache_salt, deadline_ms=int((time.time() + self.config.timeout_s) * 1000),
        )  # fmt: skip
        return int(client.page_get(msg).retrieved_tokens) // self.page_size

    # -- page interface (interface_v1) ----------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        client, _ = self._ready()
        msg = m.PageExists(instance_id=client.instance_id, keys=pack_page_keys(keys),
                           cache_salt=self.config.cache_salt)  # fmt: skip
        return int(client.page_exists(msg).hit_pages)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer:  # MLA: rank 0 writes the one copy every rank reads
            return [True] * len(keys)
        client, pages = self._ready()
        host_pages = pages.pages_of(host_indices, len(keys))
        out: list[bool] = []
        step = pages.staging_pages
        for lo in range(0, len(keys), step):
            batch = keys[lo : lo + step]
            with pages.lock_out:
                ids = pages.stage_out(host_pages[lo : lo + step])
                ok = self._set(client, batch, ids)
            out += [True] * ok + [False] * (len(batch) - ok)
        return out

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        client, pages = self._ready()
        host_pages = pages.pages_of(host_indices, len(keys))
        out: list[bool] = []
        step = pages.staging_pages
        for lo in range(0, len(keys), step):
            batch, these = keys[lo : lo + step], host_pages[lo : lo + step]
            with pages.lock_in:
                got = self._get(client, batch, pages.in_ids(these))
                pages.stage_in(these, got)
            out += [True] * got + [False] * (len(batch) - got)
            if got < len(batch):  # a prefix: nothing after the first miss was copied
                out += [False] * (len(keys) - lo - len(batch))
                break
        return out

    # -- v2 (PoolTransfer): the KV pool and the side pools -------------------------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of a hybrid model's group (SGLang calls it for every entry, the KV
        anchor included, which ``register_mem_pool_host`` registered already)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV) or name in self.side_pools:
            return
        cfg = self.config
        client = KVCacheClient(
            cfg.endpoint, model_name=f"{self.side_model_name}|pool={name}", timeout_s=cfg.timeout_s,
            daemon_uid=cfg.daemon_uid, curve_server_key=cfg.curve_server_key,
            curve_secret_key=cfg.curve_secret_key,
        )  # fmt: skip
        try:
            pool = SidePool(name, host_pool, client, cfg.timeout_s, cfg.cache_salt)
        except BaseException:
            client.close(unregister=False)
            raise
        self.side_pools[name] = pool
        log.info("kvcache: host pool %r (%d-byte pages) registered as %s", name, pool.page_bytes,
                 client.model_name)  # fmt: skip

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` for which the KV pages and every named pool's pages
        (by its hit policy) are held; ``restorable_prefix_pages`` lists every such length
        found. A pool kvcache does not hold, or a policy it does not serve, is no hit at all."""
        kv = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            if t.name == PoolName.KV or not restorable:
                continue
            pool = self.side_pools.get(str(t.name))
            if pool is None or t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                return PoolTransferResult.empty()
            try:
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    found = set(range(1, pool.leading(keys[:kv]) + 1))
                else:
                    found = pool.restorable(keys[:kv], max(1, len(t.keys or ())))
            except Exception as exc:  # the daemon did not answer: no prefix is whole
                log.warning("kvcache: exists on host pool %r failed: %s", pool.name, exc)
                return PoolTransferResult.empty()
            if found:
                hits[str(t.name)] = max(found)
            restorable &= found
        final = max(restorable, default=0)
        return PoolTransferResult(final, hits, sorted(restorable))

    def _v2(
        self, transfers: list[PoolTransfer], kv_op: Any, side: str, extra_info: Any
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            keys, name = t.keys or [], str(t.name)
            pool = self.side_pools.get(name)
            if t.host_indices is None or (t.name != PoolName.KV and pool is None):
                results[name] = [False] * len(keys)
            elif pool is None:
                results[name] = kv_op(keys, t.host_indices, extra_info)
            else:
                try:
                    results[name] = getattr(pool, side)(keys, t.host_indices)
                except Exception as exc:  # a miss for SGLang, never an error
                    log.warning("kvcache: %s of %d %r pages failed: %s", side, len(keys), name, exc)
                    results[name] = [False] * len(keys)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_get_v1, "get", extra_info)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_set_v1, "set", extra_info)

    # -- legacy (flat pages) --------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        client, pages = self._ready()
        if not self.is_writer:
            return True
        if pages.zero_copy or values is None:
            return False  # flat pages need the staging buffer: use interface_v1
        for lo in range(0, len(keys), pages.staging_pages):
            batch = keys[lo : lo + pages.staging_pages]
            with pages.lock_out:
                for slot, value in enumerate(values[lo : lo + len(batch)]):
                    pages.flat_to_stage(value, slot)
                ok = self._set(client, batch, range(len(batch)))
            if ok < len(batch):
                return False
        return True

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        client, pages = self._ready()
        if pages.zero_copy or target_locations is None:
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        step = pages.staging_pages
        for lo in range(0, len(keys), step):
            batch = keys[lo : lo + step]
            with pages.lock_in:
                base = pages.staging_pages
                got = self._get(client, batch, range(base, base + len(batch)))
                for slot in range(got):
                    pages.stage_to_flat(base + slot, target_locations[lo + slot])
            out += [target_locations[lo + i] for i in range(got)] + [None] * (len(batch) - got)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # -- housekeeping ---------------------------------------------------------------------
    def clear(self) -> bool:
        """The daemon's cache is shared by every instance and tenant: one SGLang rank does not
        wipe it (the operator restarts the daemon or lets L1/L2 evict)."""
        log.warning("kvcache: clear() ignored; the daemon's cache is shared")
        return False

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()
        pools, self.side_pools = self.side_pools, {}
        for pool in pools.values():
            pool.close()


__all__ = ["KVCacheStorage"]
