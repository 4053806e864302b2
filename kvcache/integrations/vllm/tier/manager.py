"""``KVCacheTier``: vLLM's ``SecondaryTierManager`` on the kvcache daemon.

vLLM's ``TieringOffloadingManager`` cascades every chunk its CPU primary tier stores to each
secondary tier (``submit_store``) and promotes chunks a secondary tier holds back into the
primary tier (``lookup`` then ``submit_load``). Every method runs on vLLM's scheduler thread and
must not block, so here:

* ``lookup`` answers from vLLM's own ``AsyncLookupManager``: the first ask of a chunk is
  ``RETRY``; the step's asks go to the daemon from the lookup thread, a few ``PageExists``
  round trips per request and KV cache group (``presence.py``); the answer is there for the
  next step's ask.
* ``submit_store`` / ``submit_load`` queue a job (``jobs.py``); the store and load threads copy
  rows through the staging buffer and call the daemon (``link.py``); ``get_finished_jobs``
  hands back what ended. A load that got fewer chunks than asked reports the leading ones as
  loaded (vLLM keeps them) and the rest as failed, and marks those misses so vLLM does not ask
  for them again (the livelock vLLM's fs tier guards against the same way).
* A dead, unregistered or slow daemon: lookups are misses (after ``lookup_timeout_s`` at most),
  stores and loads fail (at once while the client's breaker is open, else after
  ``timeout_s``), and vLLM's CPU tier carries on alone. Stores beyond ``max_pending_stores``
  fail at once, so a slow daemon cannot make vLLM's pinned chunks pile up.

Loaded by vLLM's ``SecondaryTierFactory`` from a ``secondary_tiers`` entry
``{"type": "KVCacheTier", "module_path": "kvcache.integrations.vllm.tier", ...}`` (keys:
``config.TierConfig``); docs/vllm.md says when to use it rather than ``KVCacheConnector``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache.errors import LayoutError
from kvcache.integrations.vllm.tier.config import TierConfig
from kvcache.integrations.vllm.tier.jobs import Finished, Job, JobRunner
from kvcache.integrations.vllm.tier.link import DaemonLink
from kvcache.integrations.vllm.tier.presence import presence_by_group
from kvcache.integrations.vllm.tier.scope import scope_fields, scoped_model_name

log = logging.getLogger("kvcache.integrations.vllm.tier")


def primary_rows(view: memoryview) -> np.ndarray:
    """The primary tier's memory as ``[chunks, row bytes]`` int8, sharing its memory."""
    arr = np.asarray(view)
    if arr.ndim != 2 or not arr.flags.c_contiguous:
        raise LayoutError(f"the primary view must be a contiguous [chunks, row] array, got {arr.shape}")
    rows = arr.view(np.int8).reshape(arr.shape[0], -1)
    assert view.strides is not None
    if rows.shape[1] != view.strides[0]:
        raise LayoutError(f"primary rows are {rows.shape[1]} bytes but {view.strides[0]} apart")
    return rows


class _DaemonLookups(AsyncLookupManager):
    """vLLM's lookup bookkeeping, asking the daemon on its thread."""

    def __init__(self, link: DaemonLink, tier_type: str) -> None:
        self._link = link
        self._outage_logged = False
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Per KV cache group (a hybrid model's groups hold different chunks at one position),
        the group's keys in prompt order, answered by leading runs (``presence.py``)."""
        try:
            out = presence_by_group(keys, req_context.get_offload_key_position, self._link.leading_held)
            self._outage_logged = False
        except Exception as err:  # no daemon, or too slow: every chunk is a miss
            if not self._outage_logged:
                log.warning("kvcache tier: lookups count as misses (%s: %s)", type(err).__name__, err)
                self._outage_logged = True
            return [False] * len(keys)
        return out


class KVCacheTier(SecondaryTierManager):
    """kvcache's daemon as one of vLLM's secondary offloading tiers (see the module doc)."""

    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **extra: Any,
    ) -> None:
        config = TierConfig.from_extra(extra)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config
        self.locality = Locality(config.locality) if config.locality is not None else None
        self._rows = primary_rows(primary_kv_view)
        self.model_name = scoped_model_name(scope_fields(offloading_spec), config.model_name)
        self.link = DaemonLink(config, self._rows.shape[1], self.model_name)
        self._runner = JobRunner(self._store_batch, self._load_batch, config.staging_chunks,
                                 config.max_pending_stores)  # fmt: skip
        self._lookups = _DaemonLookups(self.link, tier_type)
        self._job_keys: dict[int, list[OffloadKey]] = {}
        events_on = bool(getattr(offloading_spec.kv_events_config, "enable_kv_cache_events", False))
        self._events: list[OffloadingEvent] | None = [] if config.enable_kv_events and events_on else None
        if config.enable_kv_events and not events_on:
            log.warning("kvcache tier: enable_kv_events is set but vLLM's KV cache events are off")
        self.link.connect()

    # -- the threads' side ---------------------------------------------------------------
    def _store_batch(self, chunk_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        return self.link.store(self._rows, chunk_ids, keys)

    def _load_batch(self, chunk_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        return self.link.load(self._rows, chunk_ids, keys)

    # -- vLLM's contract (scheduler thread; nothing here waits on the daemon) ---------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _job(self, job: TransferJob) -> Job:
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(chunk_ids)} chunk ids")
        self._job_keys[job.job_id] = keys
        return Job(job.job_id, chunk_ids, keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._runner.submit_store(self._job(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._runner.submit_load(self._job(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._result(f) for f in self._runner.take_finished()]

    def _result(self, f: Finished) -> JobResult:
        keys = self._job_keys.pop(f.job_id, [])
        moved = f.done * self.block_size_bytes
        if not f.is_load:
            if f.success and self._events is not None and keys:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                                    locality=self.locality))  # fmt: skip
            return JobResult(
                job_id=f.job_id, success=f.success, transfer_time=f.seconds, transfer_bytes=moved
            )
        if f.success:
            return JobResult(job_id=f.job_id, success=True, transfer_time=f.seconds, transfer_bytes=moved)
        self._lookups.mark_miss(keys[f.done :])
        loaded = tuple(keys[: f.done]) or None
        return JobResult(job_id=f.job_id, success=False, successful_keys=loaded, transfer_time=f.seconds,
                         transfer_bytes=moved)  # fmt: skip

    def has_pending_work(self) -> bool:
        return self._runner.busy()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        self._runner.drain()

    @property
    def refused_stores(self) -> int:
        """Store jobs failed at once because ``max_pending_stores`` were queued."""
        return self._runner.refused_stores

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._runner.stop(self.config.timeout_s + 1.0)
        self.link.close()
        # vLLM closes the primary region next, which fails while a view of it is exported
        self._rows = np.empty((0, self.block_size_bytes), dtype=np.int8)


__all__ = ["KVCacheTier", "primary_rows"]
