"""SGLang's host KV pool as kvcache sees it: one canonical view, and how its pages reach the daemon.

Separate from the backend because it is pure tensor bookkeeping (no SGLang import): testable
with plain tensors shaped like each host layout, and the one place that knows those layouts.

Every host layout is viewed as ``[KV, NL, P, PS, NH, HS]`` (KV = 2 for MHA, 1 with NH = 1 for
MLA; P pages of PS tokens), a permutation of the buffer's own axes, so no byte moves to build it:

=====================  ==========================  ==================================
layout                 MHA buffer                  MLA buffer
=====================  ==========================  ==================================
``layer_first``        ``[2, NL, P*PS, NH, HS]``   ``[NL, P*PS, 1, HS]``
``page_first``         ``[2, P*PS, NL, NH, HS]``   ``[P*PS, NL, 1, HS]``
``page_first_direct``  ``[2, P, NL, PS, NH, HS]``  ``[P, NL, PS, 1, HS]``
``page_head``          ``[2, P, NH, PS, NL, HS]``  (none)
=====================  ==========================  ==================================

The daemon keeps each page in that canonical order (its chunk ``[KV, NL, PS, NH*HS]``), so a page
stored from one host layout is the same bytes in any other: the layout is not part of the key.

How bytes move (measured in docs/sglang.md):

* **In place (zero copy)**: a ``layer_first`` pool whose buffer lives in a kvcache memfd
  (``shared_pool.install``) is registered as it is (``TWO_X_NL_X_NBBS_NH_HS`` / MLA
  ``NL_X_NBBS_ONE_HS``): the daemon copies straight between its pages and L1, by page index.
  The other layouts cannot be: a (layer, K/V) page is not contiguous in ``page_first`` and
  ``page_head`` (tokens interleave with layers or heads), which no row of ``csrc/layouts.def``
  can address; ``page_first_direct`` could be (a new row: a page of a layer is contiguous)
  but would need the native table to grow.
* **Staged**: otherwise the backend registers a staging buffer in a sealed memfd (``2 *
  staging_pages`` pages, one half per direction) and moves pages between it and the pool with
  one ``index_select`` / ``index_copy_`` per (K/V, layer): one copy on the engine's side, no
  Python loop over pages. SGLang's own default allocator gives anonymous memory the daemon
  cannot map, and its ``shm`` allocator an unsealed memfd, which the daemon refuses (a client
  could shrink it under the daemon's mapping).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvcache.errors import LayoutError
from kvcache.transport.memfd import empty_shared, export_cpu_tensors

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def canonical_view(buf: torch.Tensor, layout: str, *, mla: bool, page_size: int) -> torch.Tensor:
    """``buf`` (a host pool's ``kv_buffer``, or one flat page of it reshaped to its layout)
    as ``[KV, NL, P, PS, NH, HS]``; a view, never a copy."""
    ps = page_size
    if mla:
        if layout == "layer_first":
            nl, size, one, hs = buf.shape
            v = buf.view(nl, size // ps, ps, one, hs)
        elif layout == "page_first":
            size, nl, one, hs = buf.shape
            v = buf.view(size // ps, ps, nl, one, hs).permute(2, 0, 1, 3, 4)
        elif layout == "page_first_direct":
            v = buf.permute(1, 0, 2, 3, 4)
        else:
            raise LayoutError(f"MLA host layout {layout!r} is not supported; use one of {MLA_LAYOUTS}")
        return v.unsqueeze(0)
    if layout == "layer_first":
        two, nl, size, nh, hs = buf.shape
        return buf.view(two, nl, size // ps, ps, nh, hs)
    if layout == "page_first":
        two, size, nl, nh, hs = buf.shape
        return buf.view(two, size // ps, ps, nl, nh, hs).permute(0, 3, 1, 2, 4, 5)
    if layout == "page_first_direct":
        return buf.permute(0, 2, 1, 3, 4, 5)
    if layout == "page_head":
        return buf.permute(0, 4, 1, 3, 2, 5)
    raise LayoutError(f"MHA host layout {layout!r} is not supported; use one of {MHA_LAYOUTS}")


# Per (MLA?, layout): the buffer axis that holds a page's tokens ("t": P*PS tokens) or its
# page index ("p": P pages), which one page narrows to PS or 1.
_PAGE_AXIS: dict[tuple[bool, str], tuple[int, str]] = {
    (False, "layer_first"): (2, "t"), (False, "page_first"): (1, "t"),
    (False, "page_first_direct"): (1, "p"), (False, "page_head"): (1, "p"),
    (True, "layer_first"): (1, "t"), (True, "page_first"): (0, "t"), (True, "page_first_direct"): (0, "p"),
}  # fmt: skip


def host_page_shape(buf: torch.Tensor, layout: str, *, mla: bool, page_size: int) -> tuple[int, ...]:
    """The shape of one page of ``buf`` in its own layout (how a flat page reshapes)."""
    axis, kind = _PAGE_AXIS[(mla, layout)]
    shape = list(buf.shape)
    shape[axis] = page_size if kind == "t" else 1
    return tuple(shape)


def in_memfd(t: torch.Tensor) -> bool:
    """Whether the daemon could map ``t`` in place (a kvcache sealed memfd)."""
    try:
        export_cpu_tensors([t])
    except LayoutError:
        return False
    return True


class HostPages:
    """A registered host pool: what to register with the daemon, and each call's block ids.

    ``kv_caches`` / ``fmt`` / ``block_size`` go to ``register_kv_caches``. ``zero_copy``:
    block ids are the pool's own page indices; otherwise ``stage_out`` / ``stage_in`` move a
    batch through the staging half of each direction (callers hold ``lock_out`` / ``lock_in``
    around the stage and the daemon call). Thread-safe under those locks.
    """

    def __init__(
        self, buf: torch.Tensor, layout: str, *, mla: bool, page_size: int, staging_pages: int
    ) -> None:
        if buf.device.type != "cpu":
            raise LayoutError(f"the host pool is on {buf.device}; kvcache maps CPU host pools only")
        self.layout, self.mla, self.page_size = layout, mla, page_size
        self.buf = buf
        self.host = canonical_view(buf, layout, mla=mla, page_size=page_size)
        kv, nl, self.num_pages, ps, nh, hs = self.host.shape
        self.page_shape = host_page_shape(buf, layout, mla=mla, page_size=page_size)
        self.zero_copy = layout == "layer_first" and buf.is_contiguous() and in_memfd(buf)
        self.staging_pages = staging_pages
        self.lock_out, self.lock_in = threading.Lock(), threading.Lock()
        if self.zero_copy:
            self.stage = self.host
            pages = self.host
        else:
            self.stage = empty_shared((kv, nl, 2 * staging_pages, ps, nh, hs), buf.dtype)
            pages = self.stage
        tokens = pages.shape[2] * ps
        if mla:
            self.kv_caches: Any = [pages[0, layer].reshape(tokens, 1, hs) for layer in range(nl)]
            self.fmt = "NL_X_NBBS_ONE_HS"
        else:
            self.kv_caches = [
                [pages[k, layer].reshape(tokens, nh, hs) for layer in range(nl)] for k in range(2)
            ]
            self.fmt = "TWO_X_NL_X_NBBS_NH_HS"
        if self.zero_copy and any(t.data_ptr() != p.data_ptr() for t, p in self._leaves_and_pages(pages)):
            raise LayoutError("the host pool's layer_first buffer is not contiguous per layer")

    def _leaves_and_pages(self, pages: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        leaves = self.kv_caches if self.mla else [t for group in self.kv_caches for t in group]
        kv, nl = pages.shape[0], pages.shape[1]
        return [(leaves[k * nl + layer], pages[k, layer]) for k in range(kv) for layer in range(nl)]

    def pages_of(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """The pool page of each of ``count`` pages from SGLang's token indices (int64)."""
        idx = host_indices.reshape(-1).to(torch.int64)
        ps = self.page_size
        if idx.numel() != count * ps:
            raise ValueError(f"{count} keys need {count * ps} host indices, got {idx.numel()}")
        first = idx[::ps] if ps > 1 else idx
        if count and (
            bool((first % ps).any()) or bool((first < 0).any()) or int(first.max()) >= self.num_pages * ps
        ):
            raise IndexError(f"host indices are not whole pages of the {self.num_pages}-page pool")
        return first // ps

    def stage_out(self, pages: torch.Tensor) -> list[int]:
        """Pool pages -> the outgoing staging half; returns their block ids there."""
        n = pages.numel()
        if self.zero_copy:
            return pages.tolist()
        for k in range(self.host.shape[0]):
            for layer in range(self.host.shape[1]):
                torch.index_select(self.host[k, layer], 0, pages, out=self.stage[k, layer, :n])
        return list(range(n))

    def in_ids(self, pages: torch.Tensor) -> list[int]:
        """Block ids a get writes into: the pool's pages, or the incoming staging half."""
        if self.zero_copy:
            return pages.tolist()
        base = self.staging_pages
        return list(range(base, base + pages.numel()))

    def stage_in(self, pages: torch.Tensor, got: int) -> None:
        """The first ``got`` pages of the incoming staging half -> their pool pages."""
        if self.zero_copy or got == 0:
            return
        base = self.staging_pages
        self.host[:, :, pages[:got]] = self.stage[:, :, base : base + got]

    # -- the legacy (flat page) interface ---------------------------------------------------
    def flat_to_stage(self, flat: torch.Tensor, slot: int) -> None:
        """One flat page (``get_data_page(i, flat=True)``) -> outgoing staging block ``slot``."""
        page = canonical_view(flat.view(self.page_shape), self.layout, mla=self.mla, page_size=self.page_size)
        self.stage[:, :, slot : slot + 1] = page

    def stage_to_flat(self, slot: int, flat: torch.Tensor) -> None:
        """Incoming staging block ``slot`` -> a flat page buffer, in the pool's layout."""
        page = canonical_view(flat.view(self.page_shape), self.layout, mla=self.mla, page_size=self.page_size)
        page[...] = self.stage[:, :, slot : slot + 1]


__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "HostPages", "canonical_view", "host_page_shape", "in_memfd"]
