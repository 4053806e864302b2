"""kvcache as a vLLM KV connector: ``kv_connector="KVCacheConnector"``,
``kv_connector_module_path="kvcache.integrations.vllm"`` (see docs/vllm.md).

The connector class imports vLLM, so it is loaded on first attribute access: the planning,
configuration and shared-memory pieces stay importable (and testable) without vLLM.
"""

from __future__ import annotations

from typing import Any

from kvcache.integrations.vllm.config import ConnectorConfig

__all__ = ["ConnectorConfig", "KVCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVCacheConnector":
        from kvcache.integrations.vllm.connector import KVCacheConnector

        return KVCacheConnector
    raise AttributeError(name)
