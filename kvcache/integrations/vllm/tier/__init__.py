"""kvcache as one of vLLM's own secondary offloading tiers (vLLM >= 0.32, ``TieringOffloadingSpec``).

Selected in the tiering spec's ``secondary_tiers``, with no connector change::

    {"type": "KVCacheTier", "module_path": "kvcache.integrations.vllm.tier",
     "endpoint": "ipc:///tmp/kvcache-1000/daemon.sock", "cache_salt": "team-a"}

``KVCacheTier`` imports vLLM, so it is loaded on first attribute access: the configuration,
presence rule, transfer threads and daemon link stay importable (and testable) without vLLM.
The parts: ``config`` (keys), ``scope`` (who shares chunks), ``presence`` (per-chunk answers from
prefix lookups), ``jobs`` (the transfer threads), ``link`` (the daemon), ``manager`` (vLLM's side).
"""

from __future__ import annotations

from typing import Any

from kvcache.integrations.vllm.tier.config import TierConfig

__all__ = ["KVCacheTier", "TierConfig"]


def __getattr__(name: str) -> Any:
    if name == "KVCacheTier":
        from kvcache.integrations.vllm.tier.manager import KVCacheTier

        return KVCacheTier
    raise AttributeError(name)
