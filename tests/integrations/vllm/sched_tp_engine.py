"""The scheduler harness's engine at tensor parallelism N, for an MLA model (vLLM venv only).

Separate from ``sched_engine.py`` (one rank of a full-attention model, which every other
scenario runs) because the ranks are its whole point: one scheduler, one worker
``KVCacheConnector`` per rank, each built at its rank (vLLM's ``tp_rank_world`` answered for
it: there is no process group here), each on KV tensors of its own allocated as vLLM's CPU
runner does and registered in the MLA shape ``[blocks, block_size, latent]``, each stepped in
vLLM's order with a fake forward of its own (``sched_model.FakeForward``: it checks every
byte of the context it reads), and the ranks' outputs merged by vLLM's ``KVOutputAggregator``,
as its executor does. The ``MLAAttentionSpec`` group's ``kv_tp_replicas`` is computed by
vLLM's own ``kv_cache_groups_tp_replicas``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash, kv_cache_groups_tp_replicas
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcache.integrations.vllm import connector as connector_mod
from kvcache.integrations.vllm.connector import KVCacheConnector, KVCacheMetadata
from kvcache.integrations.vllm.stats import Payload, merge
from tests.integrations.vllm.sched_engine import BLOCK, KV_HEADS, LAYERS, WIDTH, Engine, StepLog
from tests.integrations.vllm.sched_model import FakeForward, WrongRead

LATENT = KV_HEADS * WIDTH
"""Each block's bytes seen as ``[BLOCK, LATENT]``: the fake forward's tile is opaque bytes to
the connector (vLLM's CPU runner's pages), so one layout serves both views."""


class Rank:
    """One tensor-parallel rank: its worker connector, KV tensors and forward."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig, rank: int, names: list[str]) -> None:
        old = connector_mod.tp_rank_world
        connector_mod.tp_rank_world = lambda: (rank, config.parallel_config.tensor_parallel_size)
        try:
            self.worker = KVCacheConnector(config, KVConnectorRole.WORKER, kv_config)
        finally:
            connector_mod.tp_rank_world = old
        nb = kv_config.num_blocks
        with self.worker.get_mem_pool_context() or contextlib.nullcontext():
            raw = [torch.zeros(BLOCK * LATENT * 4 * nb, dtype=torch.int8) for _ in names]
        latent = [r.view(torch.float32).view(nb, BLOCK, LATENT) for r in raw]  # MLA: [NB, BS, HS]
        self.kv = [r.view(torch.float32).view(nb, KV_HEADS, BLOCK, WIDTH) for r in raw]
        self.worker.register_kv_caches(dict(zip(names, latent, strict=True)))
        self.forward = FakeForward(self.kv)
        self.stats: Payload = {}


class TPEngine(Engine):
    """``Engine`` with ``tp`` ranks of an MLA model (module docstring). ``rank_extra``: per
    rank, ``kv_connector_extra_config`` keys that differ from the engine's."""

    def __init__(
        self,
        config: VllmConfig,
        num_blocks: int,
        tp: int,
        rank_extra: dict[int, dict[str, Any]] | None = None,
    ) -> None:  # Engine.__init__ builds one rank of a full-attention model: not called
        init_none_hash(sha256)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32, max_tp_shards=1
        )
        groups = [KVCacheGroupSpec(names, spec)]
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        kv_config.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp)  # vLLM's own rule
        config.parallel_config.tensor_parallel_size = tp
        config.cache_config.num_gpu_blocks = num_blocks
        self.config, self.kv_config = config, kv_config
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
        self.ranks: list[Rank] = []
        for r in range(tp):
            rank_config = config
            if rank_extra and r in rank_extra:
                rank_config = copy.deepcopy(config)
                transfer = rank_config.kv_transfer_config
                transfer.kv_connector_extra_config = {**transfer.kv_connector_extra_config, **rank_extra[r]}
            self.ranks.append(Rank(rank_config, kv_config, r, names))
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.worker, self.kv, self.forward = self.ranks[0].worker, self.ranks[0].kv, self.ranks[0].forward
        self.requests: dict[str, Request] = {}
        self.identity: dict[str, str] = {}
        self.steps: list[StepLog] = []
        self.worker_stats: Payload = {}
        self.planned_loads: dict[str, int] = {}
        self.between_schedule_and_load: Callable[[int, SchedulerOutput], None] | None = None
        self.before_schedule: Callable[[int], None] | None = None
        self.aborted: set[str] = set()

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, *, identity: str = "", **kw: Any
    ) -> Request:
        for rank in self.ranks[1:]:
            rank.forward.identities[req_id] = identity
        return super().add(req_id, prompt, max_tokens, identity=identity, **kw)

    def _rank_step(self, rank: Rank, step: int, out: SchedulerOutput) -> ModelRunnerOutput:
        """One rank's ``execute_model`` in vLLM's connector order (``Engine._execute``)."""
        rank.forward.update(out)
        worker, meta = rank.worker, out.kv_connector_metadata
        assert isinstance(meta, KVCacheMetadata)
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        result = (
            rank.forward.forward(step, out)
            if out.total_num_scheduled_tokens
            else ModelRunnerOutput(req_ids=[], req_id_to_index={})
        )
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        if not out.total_num_scheduled_tokens:
            worker.wait_for_stores(0.1)
            worker.wait_for_retrieves(0.1)
        sending, recving = worker.get_finished(out.finished_req_ids)
        stats = worker.get_kv_connector_stats()
        if stats is not None:
            merge(rank.stats, copy.deepcopy(stats.data))
        result.kv_connector_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=stats,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        return result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank's step, merged by vLLM's ``KVOutputAggregator`` (rank 0's tokens)."""
        step = len(self.steps)
        if self.between_schedule_and_load is not None:
            self.between_schedule_and_load(step, out)
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVCacheMetadata)
        for load in meta.plan.retrieves:
            self.planned_loads[load.req_id] = (
                self.planned_loads.get(load.req_id, 0) + len(load.token_ids) - load.skip_tokens
            )
        outputs = [self._rank_step(rank, step, out) for rank in self.ranks]
        result = self.aggregator.aggregate(list(outputs), output_rank=0)
        assert result is not None
        conn = result.kv_connector_output
        assert conn is not None
        blocks = {r: list(self.forward.reqs[r].blocks) for r in out.num_scheduled_tokens}
        sending, recving = set(conn.finished_sending or ()), set(conn.finished_recving or ())
        self.steps.append(StepLog(step, set(conn.invalid_block_ids), blocks, sending, recving))
        return result

    def wrong_reads(self) -> list[WrongRead]:
        return [w for rank in self.ranks for w in rank.forward.wrong_reads]

    def rank_total(self, rank: int, key: str) -> float:
        value = self.ranks[rank].stats.get(key, 0)
        return 0 if isinstance(value, list) else value

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.worker.shutdown()
        self.sched_connector.shutdown()


__all__ = ["LATENT", "Rank", "TPEngine"]
