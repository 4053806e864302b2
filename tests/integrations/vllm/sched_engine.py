"""A model-free vLLM engine for the scheduler-level harness (runs in the vLLM venv only).

vLLM's real ``Scheduler`` / ``AsyncScheduler`` with ``KVCacheConnector`` as its scheduler half,
and in the same process a WORKER ``KVCacheConnector`` on KV tensors allocated the way vLLM's
CPU runner allocates them (raw byte buffers inside the connector's ``get_mem_pool_context``,
viewed as the CPU attention layout ``[blocks, kv_heads, block_size, 2 * head_size]``). Each
step follows vLLM's model runner (``gpu_model_runner.execute_model`` and
``kv_connector_model_runner_mixin``): ``handle_preemptions``, bind the metadata,
``start_load_kv`` (before the forward only when the step has synchronous loads), forward
(``sched_model.FakeForward``), ``start_load_kv`` otherwise, ``wait_for_save``, then the
connector's outputs (``get_finished``, load errors as ``invalid_block_ids``, worker metadata)
go to ``update_from_output``.

Not collected by pytest (no ``test_`` prefix): vLLM is not installed in the project's venv.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvcache.integrations.vllm.connector import KVCacheConnector, KVCacheMetadata
from kvcache.integrations.vllm.stats import Payload, merge
from tests.integrations.vllm.sched_invariants import RUN_BOUND_S, check_no_limbo, describe_unfinished
from tests.integrations.vllm.sched_model import (
    BLOCK,
    HEAD,
    KV_HEADS,
    LAYERS,
    VOCAB,
    WIDTH,
    FakeForward,
    Oracle,
    WrongRead,
)

__all__ = [
    "BLOCK",
    "KV_HEADS",
    "LAYERS",
    "WIDTH",
    "Engine",
    "Oracle",
    "StepLog",
    "vllm_config",
    "write_model_config",
]


def vllm_config(
    model_dir: str,
    extra: dict[str, Any],
    *,
    async_scheduling: bool = False,
    max_batched: int = 96,
    max_seqs: int = 16,
) -> VllmConfig:
    model = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=4096,
    )
    sched = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    transfer = KVTransferConfig(
        kv_connector="KVCacheConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvcache.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    # vLLM's CPU platform turns async scheduling off (its runner cannot overlap steps); a GPU
    # engine runs with it, and the scheduler half of the connector must be right under both.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def write_model_config(path: str) -> None:
    """A config.json is all ``ModelConfig`` reads; no weights, no tokenizer."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        torch_dtype="float32",
    ).save_pretrained(path)


@dataclass
class StepLog:
    """What one step did, for the checks: load errors reported, requests and their blocks."""

    step: int
    invalid_block_ids: set[int]
    blocks: dict[str, list[int]]
    sending: set[str]
    """Requests the worker reported sent (``finished_sending``): vLLM frees their blocks."""
    recving: set[str]
    """Requests the worker reported received (``finished_recving``): their loads settled."""


class Engine:
    """One vLLM engine: scheduler (with the connector's scheduler half) and one worker rank."""

    def __init__(self, config: VllmConfig, num_blocks: int) -> None:
        init_none_hash(sha256)
        page = KV_HEADS * BLOCK * WIDTH * 4
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],  # the scheduler never reads them; the worker allocates below
            kv_cache_groups=[
                KVCacheGroupSpec(
                    names,
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32
                    ),
                )
            ],
        )
        config.cache_config.num_gpu_blocks = num_blocks
        self.config = config
        cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        connector = self.scheduler.get_kv_connector()
        assert isinstance(connector, KVCacheConnector)
        self.sched_connector = connector
        self.worker = KVCacheConnector(config, KVConnectorRole.WORKER, kv_config)
        # As vLLM's CPU runner: raw byte buffers (inside the connector's allocation hook),
        # viewed as the CPU attention layout.
        with self.worker.get_mem_pool_context() or contextlib.nullcontext():
            raw = [torch.zeros(page * num_blocks, dtype=torch.int8) for _ in names]
        self.kv = [r.view(torch.float32).view(num_blocks, KV_HEADS, BLOCK, WIDTH) for r in raw]
        self.worker.register_kv_caches(dict(zip(names, self.kv, strict=True)))
        self.forward = FakeForward(self.kv)
        self.requests: dict[str, Request] = {}
        self.identity: dict[str, str] = {}
        self.steps: list[StepLog] = []
        self.worker_stats: Payload = {}
        self.planned_loads: dict[str, int] = {}
        """Tokens the scheduler half planned to load, per request (whatever the daemon then had)."""
        self.between_schedule_and_load: Callable[[int, SchedulerOutput], None] | None = None
        """Hook: runs after ``schedule()`` and before the worker's load (evict, kill, ...)."""
        self.before_schedule: Callable[[int], None] | None = None
        """Hook: runs where vLLM's engine core takes new requests and aborts (under async
        scheduling, while the previous step is still in flight)."""
        self.aborted: set[str] = set()

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, *, identity: str = "", **kw: Any
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **kw,
        )
        self.requests[req_id] = request
        self.identity[req_id] = identity
        self.forward.identities[req_id] = identity
        self.scheduler.add_request(request)
        return request

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The worker's ``execute_model`` with vLLM's connector order."""
        step = len(self.steps)
        if self.between_schedule_and_load is not None:
            self.between_schedule_and_load(step, out)
        self.forward.update(out)
        worker = self.worker
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVCacheMetadata)
        for load in meta.plan.retrieves:
            self.planned_loads[load.req_id] = (
                self.planned_loads.get(load.req_id, 0) + len(load.token_ids) - load.skip_tokens
            )
        worker.handle_preemptions(meta)  # first thing in vLLM's execute_model
        worker.bind_connector_metadata(meta)
        # As vLLM's runner: synchronous loads feed this step's forward; asynchronous ones
        # start after it (their requests are not in it).
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        result = (
            self.forward.forward(step, out)
            if out.total_num_scheduled_tokens
            else ModelRunnerOutput(req_ids=[], req_id_to_index={})
        )
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        if not out.total_num_scheduled_tokens:
            # Nothing ran: vLLM steps again at once, only to hear of transfers finishing. Wait
            # a little for them (bounded: a scenario may hold one until a later step).
            worker.wait_for_stores(0.1)
            worker.wait_for_retrieves(0.1)
        sending, recving = worker.get_finished(out.finished_req_ids)
        conn = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        if conn.kv_connector_stats is not None:
            merge(self.worker_stats, conn.kv_connector_stats.data)
        result.kv_connector_output = conn
        blocks = {r: list(self.forward.reqs[r].blocks) for r in out.num_scheduled_tokens}
        self.steps.append(
            StepLog(step, set(conn.invalid_block_ids), blocks, set(sending or ()), set(recving or ()))
        )
        return result

    def run(self, max_steps: int = 2000, within_s: float = RUN_BOUND_S) -> None:
        """Step until every request finished; under async scheduling the next step is
        scheduled (and executed) before the previous one's output is processed, as in
        vLLM's batch queue. After every step no request may be in limbo (``check_no_limbo``);
        a run that has not finished after ``max_steps`` steps or ``within_s`` seconds fails
        with every unfinished request's state (a request left behind hangs its caller)."""
        pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        is_async = self.config.scheduler_config.async_scheduling
        deadline = time.monotonic() + within_s
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and pending is None:
                return
            if time.monotonic() > deadline:
                break
            if self.before_schedule is not None:
                self.before_schedule(len(self.steps))
            out = self.scheduler.schedule()
            result = self._execute(out)
            if is_async:
                if pending is not None:
                    self.scheduler.update_from_output(*pending)
                pending = (out, result)
            else:
                self.scheduler.update_from_output(out, result)
            if is_async and not self.scheduler.has_requests():
                self.scheduler.update_from_output(*pending)  # type: ignore[misc]
                pending = None
            check_no_limbo(self.scheduler, len(self.steps) - 1)
        raise AssertionError(
            f"requests left behind after {len(self.steps)} steps ({within_s} s at most): "
            + describe_unfinished(self.scheduler)
        )

    def abort(self, req_id: str) -> None:
        """As a client disconnect: vLLM finishes the request as aborted."""
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(req_id)

    @property
    def is_async(self) -> bool:
        return isinstance(self.scheduler, AsyncScheduler)

    def outputs(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    def tally(self) -> dict[str, float]:
        """Both halves' counters since start, as vLLM's metrics would sum them."""
        totals: dict[str, float] = {k: v for k, v in self.worker_stats.items() if not isinstance(v, list)}
        for k, v in self.sched_connector.tally.totals().items():
            totals[k] = totals.get(k, 0) + v
        return totals

    def check_wrong_reads(self) -> None:
        """A wrong context may only be read in a step whose load errors vLLM was told about
        (it discards that step's output for the request and recomputes)."""
        by_step = {s.step: s for s in self.steps}
        for w in self.wrong_reads():
            bad_block = w.block_ids[w.first_bad_position // BLOCK]
            told = by_step[w.step].invalid_block_ids
            assert bad_block in told, (
                f"step {w.step}: {w.req_id} read a wrong KV at position {w.first_bad_position} "
                f"(block {bad_block}) that no load error reported ({sorted(told)})"
            )

    def wrong_reads(self) -> list[WrongRead]:
        return self.forward.wrong_reads

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched_connector.shutdown()
