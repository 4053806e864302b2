"""Which of vLLM's KV cache layouts kvcache offloads, and why the others are a miss.

The connector implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager
on with kvcache configured: sliding-window layers keep only their window's blocks and hybrid
Mamba / linear-attention models start at all (without ``SupportsHMA`` vLLM 0.32 turns the
manager off, and such models fail at startup). The manager gives each KV cache group its own
blocks: a block id means nothing outside its group, a sliding-window group's blocks before
the window are vLLM's null block, and a Mamba group holds one state per request, not a KV
per token.

kvcache stores chunks of per-token KV read from one set of block ids, the same for every
registered layer. So it offloads exactly the layouts in which every layer has per-token KV in
the same blocks: one group of full attention (``FullAttentionSpec``, including the
full-length sliding-window layers vLLM makes when its hybrid manager is off, and
``MLAAttentionSpec``). Any other layout (several groups, or one group of another kind) is
served as a miss: no lookup, no load, no store, no registration. A miss is always right; a
hit restoring one group and not the others would be a wrong answer (a Mamba state or a
window missing under a full-attention hit), so partial service is never offered.

NOTE: per-group offload (a sliding-window group's window chunks, a Mamba group's state at
chunk boundaries, each group registered as its own layout with keys salted by group) is not
built; docs/vllm.md says what that costs users today.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec


def offloadable(kv_cache_config: Any) -> bool:
    """Whether kvcache offloads this ``KVCacheConfig`` (module docstring). None (a caller that
    passes no config, as before vLLM 0.11) is the single full-attention layout vLLM then had."""
    if kv_cache_config is None:
        return True
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        return False
    return type(groups[0].kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec)


def describe(kv_cache_config: Any) -> str:
    """The groups' kinds, for the log line that says a model is not offloaded."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in groups) or "none"


__all__ = ["describe", "offloadable"]
