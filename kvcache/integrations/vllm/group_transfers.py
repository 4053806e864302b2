"""The worker half's page groups: register each with the daemon, copy its pages in and out.

A hybrid model's groups other than the primary (``hybrid.py``) are each registered as their
own daemon instance with one page per vLLM block (``chunk_size`` = the block size), through a
client of their own (instance id and model name from ``hybrid``, so the scheduler half names
the same instance). Attention groups register their layers' tensors as the primary does; a
Mamba layer's states (vLLM hands a list: conv and SSM state, views into one padded page per
block) are registered as that whole page, bytes, so one page copies every state of the layer.

Loads: a load's page gets are issued beside its primary retrieve and folded into its future
(``combined``): the load counts as whole only if every page arrived, else as having copied
nothing past vLLM's own hit, so the request is recomputed (``failed_recving``). Stores are
issued asynchronously and waited for before the next forward (``wait_stores``, from
``begin_step``): vLLM frees a sliding window's blocks as it slides and rewrites a Mamba block
in place, so no page copy may outlive the step that planned it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvcache.errors import KvcacheError
from kvcache.integrations.vllm.group_pages import PageGroup, PageOp
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids

if TYPE_CHECKING:
    from kvcache.integrations.vllm.hybrid import Layout

log = logging.getLogger("kvcache.integrations.vllm")


def page_view(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """A Mamba layer's states as one byte tensor ``[num_blocks, page bytes]`` over the same
    memory: every state of a block lies in that block's page (vLLM's hybrid allocation)."""
    first = states[0]
    page = first.stride(0) * first.element_size()
    storage = first.untyped_storage()
    base = first.storage_offset() * first.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    return out.set_(storage, base, (first.shape[0], page), (page, 1))


class GroupTransfers:
    """One rank's page groups (module docstring)."""

    def __init__(self, layout: Layout, make_client: Callable[[PageGroup], Any], block_size: int,
                 kv_format: str | None, timeout_s: float) -> None:  # fmt: skip
        self.layout = layout
        self.block_size = block_size
        self.kv_format = kv_format
        self.timeout_s = timeout_s
        self.clients = {g.index: make_client(g) for g in layout.pages}
        self.registered: set[int] = set()
        self._stores: list[Future[m.StoreResult]] = []

    def primary_caches(self, kv_caches: Mapping[str, Any]) -> dict[str, Any]:
        """The primary group's layers of ``kv_caches`` (what the chunk path registers)."""
        names = self.layout.layers[self.layout.primary] if self.layout.layers else tuple(kv_caches)
        return {n: kv_caches[n] for n in names if n in kv_caches}

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register every page group; one that fails is left unregistered (its loads fail,
        its lookups miss: its requests are computed)."""
        for group in self.layout.pages:
            try:
                tensors = []
                for name in self.layout.layers[group.index]:
                    kv = kv_caches[name]
                    tensors.append(page_view(kv) if group.kind == "mamba" else kv)
                unique = list({(t.data_ptr(), tuple(t.shape)): t for t in tensors}.values())
                fmt = self.kv_format
                if group.kind == "mamba" or (fmt is None and unique[0].device.type == "cpu"):
                    fmt = KVFormat.NL_X_NB_PAGE.name
                self.clients[group.index].register_kv_caches(
                    unique, engine="vllm", block_size=self.block_size, fmt=fmt, chunk_size=self.block_size
                )
                self.registered.add(group.index)
            except Exception as exc:
                log.error("kvcache: cannot register KV cache group %d (%s): %s", group.index, group.kind, exc)

    def _deadline_ms(self) -> int:
        return int((time.time() + self.timeout_s) * 1000)

    def _get(self, op: PageOp) -> Future[m.RetrieveResult]:
        client = self.clients.get(op.group)
        if client is None or op.group not in self.registered or len(op.keys) != 32 * len(op.block_ids):
            failed: Future[m.RetrieveResult] = Future()
            failed.set_exception(KvcacheError(f"group {op.group}'s pages cannot be loaded into its blocks"))
            return failed
        msg = m.PageGet(instance_id=client.instance_id, keys=op.keys, block_ids=pack_ids(op.block_ids),
                        cache_salt=op.cache_salt, deadline_ms=self._deadline_ms())  # fmt: skip
        future: Future[m.RetrieveResult] = client.session.submit(msg, m.RetrieveResult)
        return future

    def combined(
        self, skip: int, primary: Future[m.RetrieveResult], ops: Sequence[PageOp]
    ) -> Future[m.RetrieveResult]:
        """``primary``'s result once every page get of ``ops`` has settled too; a page short
        or failed makes it a load of nothing past ``skip`` (vLLM's own hit)."""
        if not ops:
            return primary
        gets = [self._get(op) for op in ops]
        out: Future[m.RetrieveResult] = Future()
        pending = [primary, *gets]

        def settle(_: Future[Any]) -> None:
            if not all(f.done() for f in pending) or out.done():
                return
            try:
                reply = primary.result()
                for op, get in zip(ops, gets, strict=True):
                    if get.result().retrieved_tokens < len(op.block_ids) * self.block_size:
                        raise KvcacheError(f"group {op.group}: not every page of the hit was held")
                out.set_result(reply)
            except BaseException as exc:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    out.set_exception(exc)

        for f in pending:
            f.add_done_callback(settle)
        return out

    def store(self, ops: Sequence[PageOp]) -> None:
        """Issue the page stores (waited for by ``wait_stores``)."""
        for op in ops:
            client = self.clients.get(op.group)
            if client is None or op.group not in self.registered or not op.block_ids:
                continue
            msg = m.PageSet(instance_id=client.instance_id, keys=op.keys, block_ids=pack_ids(op.block_ids),
                            cache_salt=op.cache_salt, deadline_ms=self._deadline_ms())  # fmt: skip
            try:
                self._stores.append(client.session.submit(msg, m.StoreResult))
            except Exception as exc:  # a page not stored is a later miss
                log.warning("kvcache: page store of group %d failed: %s", op.group, exc)

    def wait_stores(self, timeout_s: float | None = None) -> bool:
        """Wait for every page store issued; True if none is left in flight."""
        if not self._stores:
            return True
        _, pending = concurrent.futures.wait(
            self._stores, timeout=timeout_s if timeout_s is not None else self.timeout_s
        )
        for f in self._stores:
            if f.done() and f.exception() is not None:
                log.warning("kvcache: page store failed: %s", f.exception())
        self._stores = list(pending)
        return not pending

    def close(self) -> None:
        self.wait_stores()
        for index, client in self.clients.items():
            client.close(unregister=index in self.registered)


__all__ = ["GroupTransfers", "page_view"]
