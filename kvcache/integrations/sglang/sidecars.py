"""SGLang's host pools beside the KV pool (hybrid models): Mamba / linear-attention state, ...

A hybrid model's HiCache registers, after the KV pool, one more host pool per kind of state
(``register_mem_host_pool_v2``: ``PoolName.MAMBA`` for Qwen3-Next / Qwen3.5, Nemotron-H,
Granite 4, Jamba, Falcon-H1), and names each pool's pages in its ``PoolTransfer``s by the same
SGLang page hashes as the KV pages (a Mamba state by the hash of the last page it covers).
Separate from the backend because a side pool is a different thing to store: not per-token KV
in a known layout, but whatever the pool packs into one flat page. So each side pool is its own
daemon instance, registered under its own key scope (``<model>|tp<r>of<n>|pool=<name>``: a
page of one pool can never be served for another pool's, or for a KV page), with a staging
buffer of flat byte pages in a sealed memfd; pages move with the pool's own serialiser
(``get_data_page`` / ``set_from_flat_data_page``), so every pool kind SGLang defines round
trips byte for byte, whatever its layout, dtypes or side buffers.

Which prefixes a side pool restores is the caller's hit policy (``PoolHitPolicy``): every page
of the prefix (``ALL_PAGES``), or the last ``t`` pages before its end (``TRAILING_PAGES``: a
Mamba state exists only where SGLang stored one). ``restorable`` answers the second by asking
the daemon for runs of pages from the end backwards (one ``PageExists`` per run, at most
``MAX_PROBES``): the prefixes it reports restorable all are; one it has no time to probe is
left out (a shorter hit, never a wrong one).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvcache.client import KVCacheClient
from kvcache.errors import LayoutError
from kvcache.integrations.sglang.keys import pack_page_keys
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.transport.memfd import empty_shared

log = logging.getLogger("kvcache.integrations.sglang")

MAX_PROBES = 8
"""Daemon round trips one ``restorable`` may take (each covers a run of present pages and
the missing page below it)."""
STAGING_BYTES = 64 << 20
"""Staging budget per direction: a Mamba page of a large model is tens of MiB (every layer's
recurrent state), so a side pool stages as many pages as fit, at least one."""


class SidePool:
    """One side pool on the daemon (module docstring). ``set`` / ``get`` take SGLang's keys and
    host indices (``page_size`` indices per key, the page's first one its slot) and answer one
    bool per key, a leading run of True. Thread-safe: each direction's staging half has a lock."""

    def __init__(
        self, name: str, host_pool: Any, client: KVCacheClient, timeout_s: float, cache_salt: str
    ) -> None:
        self.name, self.host_pool, self.client = name, host_pool, client
        self.timeout_s, self.cache_salt = timeout_s, cache_salt
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        dummy = host_pool.get_dummy_flat_data_page()
        self.page_bytes = dummy.numel() * dummy.element_size()
        if self.page_bytes <= 0:
            raise LayoutError(f"host pool {name!r} has empty pages")
        self.slots = max(1, min(128, STAGING_BYTES // self.page_bytes))
        self.stage = empty_shared((2 * self.slots, self.page_bytes), torch.uint8)
        self.lock_out, self.lock_in = threading.Lock(), threading.Lock()
        client.register_kv_caches(
            [self.stage], engine="sglang", block_size=1, fmt="NL_X_NB_PAGE", chunk_size=1
        )

    def _deadline_ms(self) -> int:
        return int((time.time() + self.timeout_s) * 1000)

    def _slots_of(self, keys: list[str], host_indices: Any) -> list[int] | None:
        idx = host_indices.reshape(-1).to(torch.int64) if host_indices is not None else None
        if idx is None or idx.numel() != len(keys) * self.page_size:
            got = 0 if idx is None else idx.numel()
            log.error("kvcache: %d %s keys need %d host indices, got %d", len(keys), self.name,
                      len(keys) * self.page_size, got)  # fmt: skip
            return None
        return [int(i) for i in idx[:: self.page_size].tolist()]

    def leading(self, keys: list[str]) -> int:
        """How many leading pages of ``keys`` the daemon holds for this pool."""
        if not keys:
            return 0
        msg = m.PageExists(
            instance_id=self.client.instance_id, keys=pack_page_keys(keys), cache_salt=self.cache_salt
        )
        return int(self.client.page_exists(msg).hit_pages)

    def restorable(self, keys: list[str], trailing: int) -> set[int]:
        """The prefix lengths ``p`` (1..len(keys)) whose last ``trailing`` pages
        (``keys[p - trailing : p]``) this pool holds, as far as ``MAX_PROBES`` runs reach."""
        out: set[int] = set()
        end = len(keys)
        for _ in range(MAX_PROBES):
            if end <= 0:
                break
            run = self.leading(keys[:end][::-1])  # present pages end-run .. end-1
            first = end - run
            out.update(p for p in range(first + 1, end + 1) if max(0, p - trailing) >= first)
            end = first - 1  # keys[first - 1] is missing: no window below may hold it
        return out

    def set(self, keys: list[str], host_indices: Any) -> list[bool]:
        slots = self._slots_of(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        out: list[bool] = []
        for lo in range(0, len(keys), self.slots):
            batch = keys[lo : lo + self.slots]
            with self.lock_out:
                for i, slot in enumerate(slots[lo : lo + len(batch)]):
                    self.stage[i].copy_(self._flat(self.host_pool.get_data_page(slot, flat=True)))
                msg = m.PageSet(instance_id=self.client.instance_id, keys=pack_page_keys(batch),
                                block_ids=pack_ids(range(len(batch))), cache_salt=self.cache_salt,
                                deadline_ms=self._deadline_ms())  # fmt: skip
                reply = self.client.page_set(msg)
            ok = int(reply.stored_chunks + reply.skipped_chunks)
            out += [True] * ok + [False] * (len(batch) - ok)
        return out

    def get(self, keys: list[str], host_indices: Any) -> list[bool]:
        slots = self._slots_of(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        out: list[bool] = []
        base = self.slots
        for lo in range(0, len(keys), self.slots):
            batch = keys[lo : lo + self.slots]
            with self.lock_in:
                msg = m.PageGet(instance_id=self.client.instance_id, keys=pack_page_keys(batch),
                                block_ids=pack_ids(range(base, base + len(batch))),
                                cache_salt=self.cache_salt, deadline_ms=self._deadline_ms())  # fmt: skip
                got = int(self.client.page_get(msg).retrieved_tokens)
                for i, slot in enumerate(slots[lo : lo + got]):
                    self.host_pool.set_from_flat_data_page(slot, self.stage[base + i].clone())
            out += [True] * got + [False] * (len(batch) - got)
            if got < len(batch):  # a prefix: nothing after the first miss was copied
                out += [False] * (len(keys) - lo - len(batch))
                break
        return out

    def _flat(self, page: torch.Tensor) -> torch.Tensor:
        flat = page.contiguous().view(torch.uint8).reshape(-1)
        if flat.numel() != self.page_bytes:
            raise LayoutError(f"a {self.name} page has {flat.numel()} bytes, {self.page_bytes} expected")
        return flat

    def close(self) -> None:
        self.client.close()


__all__ = ["MAX_PROBES", "STAGING_BYTES", "SidePool"]
