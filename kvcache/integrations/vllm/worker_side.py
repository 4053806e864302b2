"""The connector's worker half: vLLM's hooks on one tensor-parallel rank, onto ``ConnectorWorker``.

Built only in vLLM's worker processes (``KVConnectorRole.WORKER``). It allocates the CPU KV
cache in sealed memfds (``get_mem_pool_context``), registers it with the daemon, loads
(synchronous ones before the forward; asynchronous ones are only issued) and stores after the
forward (``worker.ConnectorWorker`` does the transfers; this module maps vLLM's call order
onto it). Stores are asynchronous by default (``async_stores``): ``wait_for_save`` only issues
them. A finished request that had stores planned keeps its blocks (``delay_free_blocks``)
until the workers report every one of them settled in ``finished_sending``; a block vLLM
reused before the daemon copied it would cache another request's bytes under this one's keys.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvcache.client import KVCacheClient
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.group_transfers import GroupTransfers
from kvcache.integrations.vllm.metadata import KVCacheWorkerMeta
from kvcache.integrations.vllm.plan import StepPlan
from kvcache.integrations.vllm.shm import SharedKVAllocation
from kvcache.integrations.vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

log = logging.getLogger("kvcache.integrations.vllm")

IDLE_LOAD_WAIT_S = 0.005
"""How long a step with no forward waits for a load in flight (``get_finished``): enough for
the client's thread to get the GIL, short next to a step, so an arrival waits little longer."""


class WorkerSide:
    """The worker half of ``KVCacheConnector`` (module docstring); one per rank."""

    def __init__(
        self,
        config: ConnectorConfig,
        client: KVCacheClient,
        block_size: int,
        *,
        is_cpu: bool,
        offloads: bool = True,
        writes: bool = True,
        groups: GroupTransfers | None = None,
    ) -> None:
        self.config = config
        self.offloads = offloads
        """False: the model's KV cache layout is not offloaded (``hybrid.py``); nothing is
        registered, so the daemon holds no view of its tensors."""
        self.writes = writes
        """False: another rank holds the same bytes and stores them (``config.TPGroup``); this
        one registers and loads, and stores nothing."""
        self.client = client
        self._is_cpu = is_cpu
        self.transfers = ConnectorWorker(
            client, block_size, config.kv_format, async_stores=config.async_stores
        )
        self.transfers.groups = groups
        """A hybrid model's groups besides the primary (``group_transfers.py``)."""
        self._finished_sending: set[str] = set()  # released without a store (not registered)
        self._shm: SharedKVAllocation | None = None

    @property
    def registered(self) -> bool:
        return self.transfers.registered

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if self._is_cpu and self.config.shared_memory:
            self._shm = SharedKVAllocation()
            return self._shm
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.offloads:
            return
        groups = self.transfers.groups
        try:
            self.transfers.register(groups.primary_caches(kv_caches) if groups else kv_caches)
        except Exception as exc:
            log.error("kvcache: cannot register the KV cache, running without it: %s", exc)
        if groups is not None:
            groups.register(kv_caches)

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward: the transfers of requests preempted for this step end first."""
        self.transfers.begin_step(plan)

    def start_load(self, plan: StepPlan) -> None:
        """Synchronous loads before returning; asynchronous ones only issued."""
        self.transfers.begin_step(plan)
        if plan.retrieves:
            self.transfers.retrieve(plan)

    def save(self, plan: StepPlan) -> None:
        if not (plan.stores or plan.page_stores):
            return
        if self.transfers.registered and self.writes:
            self.transfers.store(plan)
        else:  # finished requests' blocks must still be released (vLLM waits for every rank)
            self._finished_sending.update(s.req_id for s in plan.stores if s.final)

    def get_finished(self, plan: StepPlan | None) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores are all settled, so vLLM frees their blocks;
        requests whose asynchronous loads have all settled, so vLLM schedules them (or frees
        their blocks, if they were aborted while loading). What a load did not fill is in this
        step's ``get_block_ids_with_load_errors`` or an earlier one's, never a later one's."""
        sent = self.transfers.take_finished_sending() | self._finished_sending
        self._finished_sending = set()
        idle = plan is not None and plan.idle
        received = self.transfers.take_finished_recving(IDLE_LOAD_WAIT_S if idle else 0.0)
        return (sent or None), (received or None)

    def load_errors(self) -> set[int]:
        return self.transfers.take_retrieve_errors()

    def failed_recving(self) -> set[str]:
        """Hybrid model: the requests whose load failed, reported with ``get_finished``'s."""
        return self.transfers.take_failed_recving()

    def worker_meta(self) -> KVCacheWorkerMeta | None:
        not_stored = self.transfers.take_not_stored()
        failed_step = self.transfers.take_failed_step()
        failed_async = self.transfers.take_failed_async()
        if not (not_stored or failed_step >= 0 or failed_async):
            return None
        return KVCacheWorkerMeta(not_stored, failed_step, failed_async)

    def wait_for_stores(self, timeout_s: float | None = None) -> bool:
        groups = self.transfers.groups
        pages = groups.wait_stores(timeout_s) if groups is not None else True
        return (self.transfers.wait_stores(timeout_s) if self.transfers.registered else True) and pages

    def wait_for_retrieves(self, timeout_s: float | None = None) -> bool:
        return self.transfers.wait_retrieves(timeout_s)

    def take_stats(self) -> dict[str, Any]:
        return self.transfers.tally.take() if self.transfers.registered else {}

    def shutdown(self) -> None:
        self.wait_for_stores(self.config.timeout_s)  # what was issued reaches the daemon
        self.wait_for_retrieves(self.config.timeout_s)  # no copy into the blocks after we leave
        if self.transfers.groups is not None:
            self.transfers.groups.close()
        self.client.close(unregister=self.transfers.registered)


__all__ = ["IDLE_LOAD_WAIT_S", "WorkerSide"]
