"""vLLM 0.32 alone: a request whose asynchronous KV load fails outright is never admitted again.

Minimal reproducer for vLLM (no kvcache: only vLLM's ``Scheduler`` and a toy connector),
written so it can go to vLLM's issue tracker as it is; docs/vllm.md quotes its result, and the
scheduler harness runs it (scenario ``vllm_failed_load_fact``) so that the day vLLM changes
this behaviour the connector's workaround and its documentation are revisited.

The toy connector offers every prompt's full blocks as an asynchronous load. The "worker"
reports the load finished one step later with all of its blocks invalid (a load that filled
nothing), under ``kv_load_failure_policy="recompute"``. vLLM truncates the request to 0
computed tokens and frees its blocks (``_update_waiting_for_remote_kv``), but leaves it in
``_inflight_prefills``. At its next admission the connector offers the load again; the
admission reserves ``_inflight_prefill_reserved_blocks()``, which now counts the request's
own remaining blocks, on top of the blocks it asks for. When the request needs more than half
of the free blocks that never fits: it sits in ``kv_holding_waiting``, WAITING, holding no
blocks, and the engine steps idly forever. With a cache twice as large it is admitted again.

Run: ``python vllm_failed_load_repro.py`` (prints the outcome for both cache sizes as JSON).
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
PROMPT = 1033  # 65 blocks, as in the report: 64 of them offered by the connector


class AsyncLoadEverything(KVConnectorBase_V1):
    """Scheduler side only: every prompt's full blocks are 'in the remote cache'."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        hit = (request.num_prompt_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        return (hit, True) if hit > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def _scheduler(model_dir: str, num_blocks: int) -> Scheduler:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1000,
    ).save_pretrained(model_dir)
    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            tokenizer=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=2048,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AsyncLoadEverything",
            kv_connector_module_path=__name__,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def run(num_blocks: int, steps: int = 200) -> dict[str, Any]:
    """One request through a failed asynchronous load; what became of it after ``steps``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    with tempfile.TemporaryDirectory() as model_dir:
        sched = _scheduler(model_dir, num_blocks)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    req = Request(
        request_id="r",
        prompt_token_ids=list(range(3, 3 + PROMPT)),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    sched.add_request(req)
    loads, failed, computed_steps = 0, False, 0
    for _ in range(steps):
        if not sched.has_requests():
            break
        out = sched.schedule()
        loading = [r for r in sched.kv_holding_waiting if r.status.name == "WAITING_FOR_REMOTE_KVS"]
        conn = KVConnectorOutput()
        if req in loading and not failed:  # the load settles, having filled nothing
            (blocks,) = sched.kv_cache_manager.get_block_ids("r")
            conn = KVConnectorOutput(finished_recving={"r"}, invalid_block_ids=set(blocks))
            loads, failed = loads + 1, True
        elif req in loading:  # a second load (the cache was large enough): it succeeds
            conn = KVConnectorOutput(finished_recving={"r"})
            loads += 1
        ids = list(out.num_scheduled_tokens)
        computed_steps += "r" in ids
        sampled = [
            [7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_tokens else [] for i in ids
        ]
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=conn,
            ),
        )
    waiting = "r" in sched.requests and not req.is_finished()
    return {
        "num_blocks": num_blocks,
        "finished": req.is_finished(),
        "status": req.status.name,
        "loads_reported": loads,
        "steps_computing": computed_steps,
        "in_kv_holding_waiting": req in list(sched.kv_holding_waiting),
        "in_inflight_prefills": req in sched._inflight_prefills,
        "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "left_behind": waiting,
    }


def main() -> int:
    print(json.dumps([run(72), run(144)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
