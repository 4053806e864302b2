"""A vLLM KV connector whose every method does nothing: the floor of vLLM's own connector
plumbing, for ``python -m benchmarks.vllm --decode-modes none,noop,connector`` (issue 22
item 4).

vLLM runs extra code in every step once any connector is configured (the per-layer attention
hooks, the connector output's context, the metadata's round trip to the workers). This class
adds nothing of its own to that: it matches no tokens, plans nothing, stores and loads
nothing. What a step costs with it, against vLLM without a connector, is what no connector
can avoid; what ``connector`` costs beyond it is ours.

Imported only by the bench's engine driver, inside the vLLM venv.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    """Every abstract method of vLLM's connector API, answering "nothing"."""

    # -- worker side ----------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


__all__ = ["NoopConnector"]
