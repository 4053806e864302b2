"""Which of vLLM's KV cache layouts kvcache offloads, and how each group is served.

The connector implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager
on with kvcache configured: sliding-window layers keep only their window's blocks and hybrid
Mamba / linear-attention models start at all (without ``SupportsHMA`` vLLM 0.32 turns the
manager off, and such models fail at startup). The manager gives each KV cache group its own
blocks: a block id means nothing outside its group, a sliding-window group's blocks before
the window are vLLM's null block, and a Mamba group holds a state, not a KV per token.

So each group is offloaded on its own (``layout``): the first full-attention (or MLA) group,
the *primary*, as token chunks exactly as a one-group model is; every other group as pages of
one block, each group registered with the daemon as its own instance (its own model name,
``group_name``, and instance id, ``group_instance_id``) and keyed by its group
(``group_pages.py``: which blocks a hit needs, and their keys; ``group_plan.py``: lookups and
plans). A hit is the longest chunk boundary every group can serve.

Served as a miss (no lookup, no load, no store, no registration): a layout with no
full-attention group (kvcache's prefix is the primary's), a group of another kind (chunked
local attention, sliding-window MLA, ...), or a group whose block size is not the engine's
(``cache_config.block_size``). A miss is always right; a hit restoring one group and not the
others would be a wrong answer, so partial service is never offered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

from kvcache.integrations.vllm.group_pages import PageGroup

_FULL = (FullAttentionSpec, MLAAttentionSpec)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model's KV cache groups are offloaded (module docstring)."""

    primary: int
    """vLLM's index of the group offloaded as token chunks."""
    pages: tuple[PageGroup, ...] = ()
    """Every other group, offloaded as pages."""
    layers: tuple[tuple[str, ...], ...] = ()
    """Per group index, its layers' names (``KVCacheGroupSpec.layer_names``)."""

    @property
    def hybrid(self) -> bool:
        return bool(self.pages)


def layout(kv_cache_config: Any, block_size: int) -> Layout | None:
    """The offload of this ``KVCacheConfig``, or None when kvcache serves it as a miss. None
    config (a caller that passes none, as before vLLM 0.11): one full-attention group."""
    if kv_cache_config is None:
        return Layout(0)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    primary = next((i for i, g in enumerate(groups) if type(g.kv_cache_spec) in _FULL), None)
    if primary is None:
        return None
    pages = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if i == primary:
            continue
        if spec.block_size != block_size:
            return None
        if type(spec) in _FULL:
            pages.append(PageGroup(i, "full", block_size))
        elif type(spec) is SlidingWindowSpec:
            reach = spec.sliding_window - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            pages.append(PageGroup(i, "swa", block_size, reach))
        elif type(spec) is MambaSpec and not spec.num_speculative_blocks:
            pages.append(PageGroup(i, "mamba", block_size))
        else:
            return None
    if len(groups) == 1 and groups[0].kv_cache_spec.block_size != block_size:
        return None
    return Layout(primary, tuple(pages), tuple(tuple(g.layer_names) for g in groups))


def offloadable(kv_cache_config: Any, block_size: int | None = None) -> bool:
    """Whether kvcache offloads this ``KVCacheConfig`` at all (``layout``)."""
    if kv_cache_config is None:
        return True
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    bs = block_size if block_size is not None else (groups[0].kv_cache_spec.block_size if groups else 0)
    return layout(kv_cache_config, bs) is not None


def group_name(model_name: str, group: PageGroup) -> str:
    """The daemon model name of a page group's instance: the model's, salted by the group."""
    return f"{model_name}#{group.tag.decode()}"


def group_instance_id(instance_id: int, group: PageGroup) -> int:
    """A page group's daemon instance id, derived from the primary's (the same on the
    scheduler and on the rank that registered it; each rank's primary id differs)."""
    digest = hashlib.blake2b(f"{instance_id}/{group.tag.decode()}".encode(), digest_size=4).digest()
    return (1 << 40) + int.from_bytes(digest, "little") * 4096 + instance_id % 4096


def describe(kv_cache_config: Any) -> str:
    """The groups' kinds, for the log line that says a model is not offloaded."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in groups) or "none"


__all__ = ["Layout", "describe", "group_instance_id", "group_name", "layout", "offloadable"]
