"""The scheduler half's page groups: how far every group can serve a hit, and what to store.

``group_pages.py`` says which blocks of a group a hit needs and what they are keyed by; this
module asks the daemon about them (one ``PageExists`` per group and boundary tried, through a
client per group whose instance id is the one its worker registered: scheduler and rank 0
name the same instance, as for the primary group), plans the page loads of an admitted hit,
and, each step, the page stores of what the step computed.

A hit is the longest chunk boundary ``n`` (at most the primary group's hit, above vLLM's own)
for which every page group holds every page it needs. Boundaries are tried from the longest
down, at most ``MAX_TRIES``: a miss is always right, and each try costs a round trip per group.
Stores: an attention group's blocks as each completes (each once per admission; null blocks
and blocks no boundary needs left out); a Mamba group's state only at the end of a step that
ends on a chunk boundary, the one moment vLLM's block holds the state after that boundary's
last token (vLLM's ``align`` mode keeps exactly such step-end states).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvcache.integrations.vllm.group_pages import PageGroup, PageKeys, PageOp, real_blocks
from kvcache.protocol import messages as m

log = logging.getLogger("kvcache.integrations.vllm")

MAX_TRIES = 8
"""Chunk boundaries tried per lookup, longest first."""


class GroupPlanner:
    """Page lookups, loads and stores of a hybrid model's page groups (module docstring)."""

    def __init__(self, groups: Sequence[PageGroup], clients: dict[int, Any], block_size: int) -> None:
        self.groups = list(groups)
        self.clients = clients
        """Per group index: the ``KVCacheClient`` naming that group's instance at the daemon."""
        self.keys = PageKeys(block_size)
        self._stored: dict[str, dict[int, int]] = {}  # req -> group -> tokens whose blocks are planned

    def hit(self, req_id: str, tokens: Sequence[int], key_extra: str, cache_salt: str,
            upto: int, local: int, chunk: int) -> int:  # fmt: skip
        """The longest chunk boundary in ``(local, upto]`` every page group can serve, or 0."""
        n = upto // chunk * chunk
        for _ in range(MAX_TRIES):
            if n <= local:
                return 0
            if all(self._held(req_id, tokens, key_extra, cache_salt, g, n, local) for g in self.groups):
                return n
            n -= chunk
        return 0

    def _held(self, req_id: str, tokens: Sequence[int], key_extra: str, cache_salt: str,
              group: PageGroup, n: int, local: int) -> bool:  # fmt: skip
        blocks = group.needed(n, local)
        if not blocks:
            return True
        keys = self.keys.keys(req_id, tokens, key_extra, group, blocks, n)
        client = self.clients[group.index]
        msg = m.PageExists(instance_id=client.instance_id, keys=keys, cache_salt=cache_salt)
        return int(client.page_exists(msg).hit_pages) == len(blocks)

    def loads(self, req_id: str, tokens: Sequence[int], key_extra: str, cache_salt: str,
              tables: Sequence[Sequence[int]], local: int, n: int) -> list[PageOp]:  # fmt: skip
        """The page loads restoring every page group at boundary ``n``. A block vLLM did not
        give (missing or null) makes its op unservable (no block ids for its keys): the
        workers then fail the load, and vLLM recomputes the request."""
        ops = []
        for group in self.groups:
            blocks = group.needed(n, local)
            if not blocks:
                continue
            keys = self.keys.keys(req_id, tokens, key_extra, group, blocks, n)
            ids = real_blocks(tables[group.index], blocks)
            ops.append(PageOp(req_id, group.index, keys, ids or [], cache_salt))
        self._stored[req_id] = {g.index: n for g in self.groups}  # loaded: no need to store again
        return ops

    def stores(self, req_id: str, tokens: Sequence[int], key_extra: str, cache_salt: str,
               tables: Sequence[Sequence[int]], before: int, scheduled: int,
               chunk: int) -> list[PageOp]:  # fmt: skip
        """The page stores of what this step computes (module docstring)."""
        end = before + scheduled
        computed = min(end, len(tokens))
        stored = self._stored.setdefault(req_id, {})
        ops = []
        for group in self.groups:
            table, start = tables[group.index], stored.get(group.index, 0)
            if group.kind == "mamba":
                if computed == end and computed % chunk == 0 and computed > start:
                    blocks = [(computed - 1) // group.block_size]
                    stored[group.index] = computed
                else:
                    continue
            else:
                blocks = group.stored_blocks(start, computed, chunk)
                stored[group.index] = max(start, computed // group.block_size * group.block_size)
            blocks = [j for j in blocks if real_blocks(table, [j]) is not None]
            if blocks:
                keys = self.keys.keys(req_id, tokens, key_extra, group, blocks, computed)
                ops.append(PageOp(req_id, group.index, keys, [table[j] for j in blocks], cache_salt))
        return ops

    def preempted(self, req_id: str) -> None:
        """vLLM freed its blocks: a resumed request stores what it recomputes again."""
        self._stored.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._stored.pop(req_id, None)
        self.keys.forget(req_id)


__all__ = ["MAX_TRIES", "GroupPlanner"]
