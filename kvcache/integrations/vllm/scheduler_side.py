"""The connector's scheduler half: lookups, load and store plans, finished requests.

Built only in vLLM's scheduler process (``KVConnectorRole.SCHEDULER``); it never touches a
KV tensor. It asks the daemon how much of a prompt it holds beyond vLLM's own prefix hit
(``get_num_new_matched_tokens``), plans loads and chunk-aligned stores (``plan.Planner``),
reports block allocations and finished requests to the daemon (its L0 lifecycle metrics),
and ships each step's plan to the workers as the connector metadata.

Loads are asynchronous by default (``async_loads``; always under async scheduling, whose
recovery from a failed synchronous load is not exact): a loading request waits in
``WAITING_FOR_REMOTE_KVS`` while the other requests' steps go on, and a request needing the
prefix it loads waits for it (``shared_loads.py``). vLLM 0.32 keeps an aborted loading
request's blocks until its load is reported (``request_finished`` holds them no longer).

State: one ``Tracked`` record per request the half keys (admitted, not finished), dropped
with everything else known about the request in one place (``_forget``). The helpers kept
beside it hold rules over several requests at once (a lookup batch, the loads others may
share, which loads are lone enough to be synchronous), each forgetting a finished request
there too. ``_loading`` outlives a record: an aborted request's load is in flight until the
workers report it, and it still counts as a load in flight for ``RetrieveTiming``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvcache.client import KVCacheClient
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.disagg import SplitRequests
from kvcache.integrations.vllm.dropped_loads import DroppedLoads
from kvcache.integrations.vllm.group_plan import GroupPlanner
from kvcache.integrations.vllm.lookups import StepLookups
from kvcache.integrations.vllm.plan import Admission, Planner, StepPlan
from kvcache.integrations.vllm.request_keys import request_key_extra
from kvcache.integrations.vllm.retrieve_timing import RetrieveTiming
from kvcache.integrations.vllm.shared_loads import SharedLoads
from kvcache.integrations.vllm.stats import ConnectorTally

log = logging.getLogger("kvcache.integrations.vllm")


@dataclass(slots=True)
class Tracked:
    """What the scheduler half holds for one admitted request it keys, until it finishes."""

    request: Any
    """vLLM's ``Request`` (its tokens, hashes and computed count are read each step)."""
    key_extra: str = ""
    stores_planned: bool = False
    """Stores were planned for it under ``async_stores``: at its end vLLM keeps its blocks
    until the workers report them settled."""


class SchedulerSide:
    """The scheduler half of ``KVCacheConnector`` (module docstring); one per vLLM scheduler."""

    def __init__(
        self,
        config: ConnectorConfig,
        client: KVCacheClient,
        block_size: int,
        *,
        producer: bool,
        pass_hashes: bool,
        async_scheduling: bool,
        offloads: bool = True,
        groups: GroupPlanner | None = None,
        primary: int = 0,
    ) -> None:
        self.config = config
        self.client = client
        self.block_size = block_size
        self._producer = producer  # its finished requests name what they stored
        self._pass_hashes = pass_hashes  # vLLM's block hashes are per block of ours
        self._groups = groups
        """A hybrid model's groups besides the primary (``group_plan.py``): its loads are
        asynchronous, the only ones vLLM lets fail per request with several groups."""
        self._primary = primary  # the index of the group offloaded as token chunks
        self._async_retrieves = config.async_loads or async_scheduling or groups is not None
        sync_lone = config.sync_lone_loads and not async_scheduling and groups is None
        self._timing = RetrieveTiming(self._async_retrieves, sync_lone)
        self.offloads = offloads
        """False: the model's KV cache layout is not offloaded (``hybrid.py``): every request
        is a miss and is neither tracked nor stored."""
        self._planner: Planner | None = None
        self._requests: dict[str, Tracked] = {}
        self.tally = ConnectorTally()
        """The scheduler half's statistics (lookups, requests not cached) for vLLM's metrics."""
        self._steps = 0  # plans built
        self._failures_seen = -1  # the last step whose load failures vLLM has processed
        self._loading: set[str] = set()  # asynchronous retrieves planned, not yet reported received
        self._loads = SharedLoads()  # those loads' prefixes: requests needing the same one wait
        self._dropped = DroppedLoads()  # their next admission computes (a load would hang)
        self._split = SplitRequests(self.tally)  # decode requests: what their transfer params name
        self._lookups = StepLookups(self.client, self.tally, self.config, self._dropped)

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
        if not self.offloads:
            return 0, False
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
        if awaited and self._groups is not None:
            return 0, False  # NOTE: a prefill/decode split of a hybrid model is not offloaded
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
        hit = found.hit_tokens
        if self._groups is not None and hit > num_computed_tokens:
            upto, salt = min(hit, len(prompt) - 1), request.cache_salt or ""
            try:  # the longest boundary every group serves
                hit = self._groups.hit(request.request_id, prompt, key_extra, salt, upto,
                                       num_computed_tokens, planner.chunk_size)  # fmt: skip
            except Exception as exc:
                log.warning("kvcache: group lookup failed: %s", exc)
                self.tally.count("lookup_failures")
                return 0, False
        external = planner.external_tokens(len(prompt), num_computed_tokens, hit)
        shared = external and self._async_retrieves and self.config.shared_loads
        if shared and self._loads.behind(request, num_computed_tokens, planner.chunk_size, key_extra):
            return None, False  # not yet: vLLM caches that load's blocks, then asks again
        if not external:
            return 0, False
        l2 = found.l2_hit_tokens if fresh else None  # older: its chunks may be in L2 by now
        return external, self._timing.choose(request.request_id, l2, bool(self._loading))

    def on_new_request(self, request: Any) -> None:
        """vLLM 0.32 calls this for every request it adds (``Scheduler.add_request``): the
        request's lookup can travel with the next one asked (``StepLookups``)."""
        self._lookups.waiting(request)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int,
                                 tables: Any = ()) -> None:  # fmt: skip
        """vLLM gave ``request`` its blocks (``block_ids``: the primary group's; ``tables``:
        every group's) with ``num_external_tokens`` promised to a load."""
        req_id = request.request_id
        is_async = self._timing.admit(req_id)  # every admission counts, keyed by us or not
        if not self.offloads:
            self.tally.count("requests_not_cached")
            return
        planner = self._get_planner()
        if planner is None:
            return
        self._dropped.admitted(req_id)  # a later admission (a preemption) may load
        key_extra = request_key_extra(request)
        if key_extra is None:  # never stored either
            self.tally.count("requests_not_cached")
            return
        if req_id not in self._requests:  # a resumed request keeps its record
            self._requests[req_id] = Tracked(request, key_extra)
        local = self._lookups.admitted(req_id, request.num_computed_tokens)
        loaded_into = block_ids if num_external_tokens else []
        whole, tail, _ = self._split.get(req_id)  # a decode request: its loads are asynchronous
        is_async = is_async or whole + tail > 0
        wait_ms = int(self.config.transfer_wait * 1000)
        external = min(num_external_tokens, max(0, whole - local)) if tail else num_external_tokens
        pages = []
        if self._groups is not None and external > 0:
            prompt = request.prompt_token_ids or []
            pages = self._groups.loads(req_id, prompt, key_extra, request.cache_salt or "", tables, local,
                                       local + external)  # fmt: skip
        planner.on_alloc(
            Admission(
                req_id=req_id,
                prompt=request.prompt_token_ids or [],
                block_ids=loaded_into,
                local_hit=local,
                external=external,
                cache_salt=request.cache_salt or "",
                key_extra=key_extra,
                is_async=is_async,
                awaited_tokens=whole,
                wait_ms=wait_ms,
                pages=pages,
            )
        )
        self._split.tail_load(planner, request, loaded_into, local, key_extra, wait_ms)
        if is_async and num_external_tokens > 0:
            self._loading.add(req_id)
            self._dropped.loading(req_id)
            self._loads.started(request, local + num_external_tokens, key_extra)

    def update_connector_output(self, received: Any, worker_meta: Any) -> None:
        """The workers' report of a step: asynchronous loads settled (``received``), and
        what the plan assumed stored but is not, and which step's loads failed (``worker_meta``,
        a ``KVCacheWorkerMeta`` or None)."""
        self._loads.ended(received)
        self._loading.difference_update(received)
        if worker_meta is None:
            return
        self._dropped.failed(r for r in worker_meta.failed_async if r in self._requests)
        if self._planner is not None:
            for req_id, upto in worker_meta.not_stored.items():
                self._planner.not_stored(req_id, upto)
            # vLLM handled this output's load errors just before: from the next plan on, it
            # recomputes the blocks those loads left unfilled.
            self._failures_seen = max(self._failures_seen, worker_meta.failed_step)

    def build_plan(self, scheduler_output: Any, block_state: Any) -> StepPlan:
        """This step's plan; ``block_state``: vLLM's per-request block ids (the scheduler
        output's, or the manager's), read for every request scheduled."""
        planner = self._planner
        self._steps += 1
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if planner is None:
            return StepPlan(step=self._steps, failures_seen=self._failures_seen, idle=idle)
        preempted = list(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in preempted:
            planner.preempted(req_id)
            if self._groups is not None:
                self._groups.preempted(req_id)
            tracked = self._requests.get(req_id)
            if tracked is not None:
                self._lookups.waiting(tracked.request)  # waits again: its next admission asks again
        self._timing.planned()
        rows, plan_pages = [], []
        self._dropped.ran(scheduler_output.num_scheduled_tokens)
        changed = blocks_changed(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None or block_state is None:
                continue
            request = tracked.request
            if (
                changed is not None
                and self._groups is None  # a hybrid model's page groups have boundaries of their own
                and req_id not in changed
                and not planner.store_due(req_id, request.num_computed_tokens + n, len(request.all_token_ids))
            ):
                continue  # no block to report, no chunk to store: its block table is not read
            groups = block_state.get_block_ids(req_id)
            if not groups:
                continue
            hashes = request.block_hashes if self._pass_hashes else []
            table = groups[self._primary]
            rows.append((req_id, request.num_computed_tokens, n, request.all_token_ids, table, hashes))
            if self._groups is not None and self.config.store:
                plan_pages.extend(self._groups.stores(
                    req_id, request.all_token_ids, tracked.key_extra, request.cache_salt or "", groups,
                    request.num_computed_tokens, n, planner.chunk_size,
                ))  # fmt: skip
        plan, records = planner.step(rows)
        plan.page_stores = plan_pages
        plan.step, plan.failures_seen, plan.idle = self._steps, self._failures_seen, idle
        plan.preempted = preempted
        if not self.config.store:
            plan.stores = []
        elif self.config.async_stores:
            for spec in plan.stores:
                if (tracked := self._requests.get(spec.req_id)) is not None:
                    tracked.stores_planned = True
        if records:
            try:
                self.client.report_block_allocations(records, wait=False)
            except Exception as exc:
                log.debug("kvcache: allocation report dropped: %s", exc)
        return plan

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
        tracked = self._requests.get(req_id)
        delay, params = False, None
        # ``_loading`` forgets it when the workers report it received.
        if req_id not in self._loading and self._planner is not None and self.config.store:
            # KV is written for every computed token whose step has finished.
            written = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            hashes = request.block_hashes if self._pass_hashes else []
            delay = self._planner.final_store(req_id, request.all_token_ids, block_ids, written, hashes)
            params, tail = (
                self._split.finished(self._producer, self._planner, request, block_ids, written)
                if self._groups is None
                else (None, False)
            )
            planned = tracked is not None and tracked.stores_planned
            if planned and not (delay or tail):  # a tail store is final too
                self._planner.release(req_id)
            delay = delay or tail or planned
        self._forget(req_id)
        return delay, params

    def _forget(self, req_id: str) -> None:
        """Drop everything the half knows of a finished request, in one place."""
        self._requests.pop(req_id, None)
        self._lookups.forget(req_id)
        self._timing.finished(req_id)
        self._dropped.forget(req_id)
        self._loads.ended((req_id,))
        self._split.forget(req_id)
        if self._groups is not None:
            self._groups.forget(req_id)
        if self._planner is not None and self._planner.finish(req_id):
            try:
                self.client.end_session(req_id, wait=False)
            except Exception as exc:
                log.debug("kvcache: end of session %s dropped: %s", req_id, exc)


def blocks_changed(scheduler_output: Any) -> set[str] | None:
    """The requests whose block table vLLM changed in this step: those scheduled for the
    first time or resumed (their whole table is new) and those given new blocks. None when the
    scheduler output does not say (every scheduled request's table is then read).

    WHY: ``build_plan`` needs a request's block ids only to report blocks vLLM has not
    reported yet or to store a chunk; asking vLLM for them (``get_block_ids`` builds the whole
    list) for every request on every step was a third of the plan's cost on a decode step, where
    a request gets a block every ``block_size`` tokens and completes a chunk every
    ``chunk_size``. A table only grows in a step that schedules its request (or admits it
    with a load, and such a request is scheduled as new or resumed later), so a request not
    named here holds exactly the blocks already reported for it."""
    new = getattr(scheduler_output, "scheduled_new_reqs", None)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if new is None or cached is None or len(cached.req_ids) != len(cached.new_block_ids):
        return None
    out = {r.req_id for r in new}
    out.update(cached.resumed_req_ids)
    out.update(r for r, b in zip(cached.req_ids, cached.new_block_ids, strict=True) if b is not None)
    return out


__all__ = ["SchedulerSide", "Tracked", "blocks_changed"]
