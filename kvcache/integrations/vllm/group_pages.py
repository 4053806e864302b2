"""Per-group pages of a hybrid model: which blocks of which group a hit needs, and their keys.

Under vLLM's hybrid KV cache manager each KV cache group has its own blocks. The first
full-attention group (the "primary") is offloaded as any model's KV is: token chunks, looked
up as a prefix (``plan.py``). Every other group is offloaded as *pages*, one vLLM block each,
through the daemon's page API (``PageExists`` / ``PageSet`` / ``PageGet``), because what such
a group needs for a hit is not a prefix of chunks:

* a sliding-window group needs only the blocks holding the ``reach`` tokens before the hit
  (``window - 1 + extra_retained_tokens``, what vLLM keeps of it); its blocks before that are
  vLLM's null block and are never stored nor loaded into;
* a Mamba / linear-attention group needs one block: the state after the hit's last token,
  which vLLM keeps in the block holding that token (``(n - 1) // block_size``);
* another full-attention group needs all its blocks, as the primary does.

A page's key names exactly what its bytes depend on: an attention block the tokens up to its
end, a state the tokens up to the boundary it was taken at. Keys are chained SHA-256 over the
request's tokens (one link per ``block_size`` tokens, rooted in the request's ``key_extra``),
then salted by the group (index, kind, block size, reach), so one group's page is never served
as another's; the daemon scopes them further by the group's own registration (its model name
and tensor geometry) and the cache salt.

A hit is a chunk boundary ``n`` for which every page group holds every page it needs
(``PageGroup.needed``); blocks below vLLM's own hit are vLLM's and are neither checked nor
written. No vLLM import: pure rules on plain values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0
"""vLLM's null block id (``BlockPool.null_block``, the pool's first block): a placeholder in a
block table, never real data."""

_ROOT = b"kvcache.vllm.group-pages.v1|"


@dataclass(frozen=True, slots=True)
class PageGroup:
    """One KV cache group kvcache offloads as pages (module docstring)."""

    index: int
    """vLLM's index of the group (its position in ``KVCacheConfig.kv_cache_groups``)."""
    kind: str
    """``"swa"``, ``"mamba"`` or ``"full"``."""
    block_size: int
    reach: int = 0
    """Sliding window: tokens before a position that it still reads (``window - 1 + extra``)."""

    @property
    def tag(self) -> bytes:
        return f"g{self.index}:{self.kind}:{self.block_size}:{self.reach}".encode()

    def needed(self, n: int, local: int) -> list[int]:
        """Block indices a request resuming at token ``n`` needs from the daemon, leaving out
        those below ``local`` (vLLM's own hit, whose blocks it holds)."""
        bs = self.block_size
        last = (n - 1) // bs
        if self.kind == "mamba":
            first = last
        elif self.kind == "swa":
            first = max(0, n - self.reach) // bs
        else:
            first = 0
        return list(range(max(first, local // bs), last + 1))

    def page_end(self, block: int, n: int) -> int:
        """The tokens whose prefix decides block ``block``'s bytes at boundary ``n``."""
        return n if self.kind == "mamba" else (block + 1) * self.block_size

    def stored_blocks(self, start: int, computed: int, chunk: int) -> list[int]:
        """Attention blocks completed in ``[start, computed)`` that a hit at some chunk
        boundary needs (a sliding window's blocks far before every boundary are not)."""
        bs = self.block_size
        out = []
        for j in range(start // bs, computed // bs):
            end = (j + 1) * bs
            boundary = -(-end // chunk) * chunk  # the first hit this block can serve
            if j in self.needed(boundary, 0):
                out.append(j)
        return out


@dataclass(slots=True)
class PageOp:
    """Copy one group's blocks to or from the daemon's pages ``keys`` (32 bytes each, in order)."""

    req_id: str
    group: int
    keys: bytes
    block_ids: list[int]
    cache_salt: str = ""


@dataclass(slots=True)
class _Chain:
    extra: str
    links: list[bytes] = field(default_factory=list)


class PageKeys:
    """Per request, the chained hashes of its tokens, grown as its tokens are known."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[str, _Chain] = {}

    def link(self, req_id: str, tokens: Sequence[int], key_extra: str, end: int) -> bytes:
        """The hash of ``tokens[:end]`` (``end`` a multiple of the block size)."""
        chain = self._chains.get(req_id)
        if chain is None or chain.extra != key_extra:
            chain = self._chains[req_id] = _Chain(
                key_extra, [hashlib.sha256(_ROOT + key_extra.encode()).digest()]
            )
        bs, links = self.block_size, chain.links
        while len(links) <= end // bs:
            k = len(links) - 1
            links.append(
                hashlib.sha256(links[k] + array("q", tokens[k * bs : (k + 1) * bs]).tobytes()).digest()
            )
        return links[end // bs]

    def keys(self, req_id: str, tokens: Sequence[int], key_extra: str, group: PageGroup,
             blocks: Sequence[int], n: int) -> bytes:  # fmt: skip
        """The page keys of ``blocks`` of ``group`` at boundary ``n``."""
        return b"".join(
            hashlib.sha256(self.link(req_id, tokens, key_extra, group.page_end(j, n)) + group.tag).digest()
            for j in blocks
        )

    def forget(self, req_id: str) -> None:
        self._chains.pop(req_id, None)


def real_blocks(table: Sequence[int], blocks: Sequence[int]) -> list[int] | None:
    """The ids of ``blocks`` in ``table``; None if one is missing or vLLM's null block."""
    if blocks and blocks[-1] >= len(table):
        return None
    ids = [table[j] for j in blocks]
    return None if NULL_BLOCK in ids else ids


__all__ = ["NULL_BLOCK", "PageGroup", "PageKeys", "PageOp", "real_blocks"]
