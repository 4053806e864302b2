"""Lifecycle of the serving engine's GPU KV blocks (L0), reconstructed from allocation records.

A separate subscriber from the plain counters because it keeps a shadow map of blocks,
which costs memory and CPU; operators switch it on (``--disable-lifecycle-metrics`` off)
when sizing the GPU cache or the offload tier. Sampling bounds the cost: a block
(``(instance_id, block_id)``) is tracked or not by a stable hash, decided once and final.

For each ``BlockAllocationRecord`` of an MP_VLLM_BLOCK_ALLOCATION event, every sampled block
is classified against its shadow entry:

1. not tracked                      -> new block: allocation time = now.
2. owned by this request already    -> decode continuation: ignored.
3. different tokens                 -> the engine evicted the old content: record its
                                       lifetime (now - allocation) and idle-before-evict
                                       (now - last access), then start over as case 1.
4. same tokens, another live owner  -> prefix sharing: co-owner, not a reuse.
5. same tokens, no live owner       -> true reuse: record the reuse gap now
                                       (now - previous use; the first gap runs from the
                                       allocation), never deferred to eviction.

MP_VLLM_END_SESSION releases the request's blocks (they stay in the shadow map, now
ownerless, until reused or overwritten). "Last access" is the latest allocation, share,
reuse or release; "previous use" is the latest allocation or reuse.

A block's tokens: when the event carries ``block_size``, block i of a record holds
``new_token_ids[i*block_size:(i+1)*block_size]``; otherwise every block of the record is
identified by the record's whole ``new_token_ids``. Only a fingerprint (hash) is kept.

Bounded state, whatever the engine reports. Per instance, blocks are bounded by its cache
(the engine refuses block ids outside it). INSTANCE_UNREGISTERED forgets an instance's
blocks and requests; its histogram series stay (a finished engine's figures must still reach
the next scrape) until the instance cap retires them. Beyond that, two caps guard against an
engine that never ends its requests or instances that vanish without unregistering (a
crash, a lost event): ``max_requests`` requests followed at once, least recently reported
first out (treated as ended), and ``max_instances`` instances, least recently reported
first out (state and series forgotten). Both are counted
(``kvcache_l0_lifecycle_dropped_total{reason}``) and logged at most once a minute.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import (
    BlockAllocationRecord,
    Event,
    EventType,
    InstanceUnregistered,
    MpVllmBlockAllocation,
    MpVllmEndSession,
)
from kvcache.observability.instruments import LIFETIME_SECONDS, Family, Histogram, MetricSet
from kvcache.observability.sampling import Sampler

LABELS = ("instance_id", "model_name")
DEFAULT_MAX_REQUESTS = 1 << 16
DEFAULT_MAX_INSTANCES = 1024
WARN_INTERVAL_S = 60.0

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Block:
    fingerprint: int
    allocated_at: float
    last_use: float  # allocation or latest reuse: start of the next reuse gap
    last_access: float  # any touch incl. share and release: start of idle-before-evict
    owners: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Histograms:
    lifetime: Histogram
    idle_before_evict: Histogram
    reuse_gap: Histogram


@dataclass(slots=True)
class _Instance:
    model_name: str
    hists: _Histograms
    blocks: dict[int, _Block] = field(default_factory=dict)


class L0LifecycleSubscriber(EventSubscriber):
    """Block lifetime, idle-before-evict and reuse-gap histograms per instance and model."""

    def __init__(
        self,
        sample_rate: float,
        registry: CollectorRegistry | None,
        instances: Iterable[tuple[int, str]] = (),
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_instances: int = DEFAULT_MAX_INSTANCES,
    ) -> None:
        """``max_requests``: requests followed at once (an engine that never reports their
        end cannot grow this state: the least recently reported is treated as ended);
        ``max_instances``: instances followed at once (the least recently reported is
        forgotten). ``instances``: (instance_id, model_name) whose series exist from the start."""
        if max_requests < 1 or max_instances < 1:
            raise ValueError("max_requests and max_instances must be >= 1")
        self.sampler = Sampler(sample_rate)
        self.max_requests = max_requests
        self.max_instances = max_instances
        m = self.metrics = MetricSet()
        self._lifetime = m.add(
            "kvcache_l0_block_lifetime_seconds",
            "GPU block: allocation of its content to its eviction (sampled blocks).",
            "histogram",
            LABELS,
            LIFETIME_SECONDS,
        )
        self._idle = m.add(
            "kvcache_l0_block_idle_before_evict_seconds",
            "GPU block: last access to eviction (sampled blocks).",
            "histogram",
            LABELS,
            LIFETIME_SECONDS,
        )
        self._reuse_gap = m.add(
            "kvcache_l0_block_reuse_gap_seconds",
            "GPU block: time between uses of the same content by later requests (sampled).",
            "histogram",
            LABELS,
            LIFETIME_SECONDS,
        )
        dropped = m.add(
            "kvcache_l0_lifecycle_dropped_total",
            "L0 lifecycle state dropped at a cap: requests never ended, instances never unregistered.",
            "counter",
            ("reason",),
        )
        self._dropped_requests = dropped.counter("request_cap")
        self._dropped_instances = dropped.counter("instance_cap")
        self._warned_at = -math.inf
        # Least recently reported first. OrderedDict, not dict: dropping the first entry of a
        # dict over and over is quadratic (the deleted slots are scanned every time).
        self._instances: OrderedDict[int, _Instance] = OrderedDict()
        # (instance_id, req_id) -> sampled block ids it holds
        self._requests: OrderedDict[tuple[int, str], set[int]] = OrderedDict()
        for instance_id, model_name in instances:
            self._instance(instance_id, model_name, 0.0)
        if registry is not None:
            m.register(registry)

    @property
    def tracked_requests(self) -> int:
        """Requests followed now (bounded by ``max_requests``)."""
        return len(self._requests)

    @property
    def tracked_instances(self) -> int:
        """Instances followed now (bounded by ``max_instances``)."""
        return len(self._instances)

    @property
    def tracked_blocks(self) -> int:
        """Blocks currently in the shadow maps (the subscriber's memory, in entries)."""
        return sum(len(inst.blocks) for inst in self._instances.values())

    @property
    def requests_dropped(self) -> int:
        """Requests treated as ended because ``max_requests`` was reached."""
        return int(self._dropped_requests.value)

    @property
    def instances_dropped(self) -> int:
        """Instances forgotten because ``max_instances`` was reached."""
        return int(self._dropped_instances.value)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.MP_VLLM_BLOCK_ALLOCATION: self._on_allocation,
            EventType.MP_VLLM_END_SESSION: self._on_end_session,
            EventType.INSTANCE_UNREGISTERED: self._on_unregistered,
        }

    def _instance(self, instance_id: int, model_name: str, now: float) -> _Instance:
        """The instance's state, now the most recently reported; created (with its series
        at zero) on first sight. The same id with another model is another cache."""
        instances = self._instances
        inst = instances.get(instance_id)
        if inst is not None:
            if inst.model_name == model_name:
                instances.move_to_end(instance_id)
                return inst
            self._forget(instance_id)
        values = (str(instance_id), model_name)
        fams: tuple[Family, Family, Family] = (self._lifetime, self._idle, self._reuse_gap)
        inst = _Instance(model_name, _Histograms(*(f.histogram(*values) for f in fams)))
        instances[instance_id] = inst
        while len(instances) > self.max_instances:
            self._forget(next(iter(instances)))
            self._dropped_instances.inc()
            self._warn(now)
        return inst

    def _forget(self, instance_id: int) -> None:
        """Drop everything about an instance: blocks, requests, histogram series."""
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        for fam in (self._lifetime, self._idle, self._reuse_gap):
            fam.remove(str(instance_id), inst.model_name)
        for key in [k for k in self._requests if k[0] == instance_id]:
            del self._requests[key]

    def _warn(self, now: float) -> None:
        if now - self._warned_at < WARN_INTERVAL_S:
            return
        self._warned_at = now
        log.warning(
            "L0 lifecycle: dropped %d requests that never ended (cap %d) and %d instances that "
            "never unregistered (cap %d) so far; is the engine reporting request ends?",
            self.requests_dropped, self.max_requests, self.instances_dropped, self.max_instances,
        )  # fmt: skip

    def _on_allocation(self, event: Event) -> None:
        md = cast(MpVllmBlockAllocation, event.metadata)
        instance_id = md.instance_id
        block_size = md.block_size or None  # 0: the publisher did not know it
        now = event.timestamp
        assert now is not None
        inst = self._instance(instance_id, md.model_name, now)
        for record in md.records:
            self._process_record(instance_id, inst, record, block_size, now)
        requests = self._requests
        while len(requests) > self.max_requests:  # least recently reported first
            (old_instance, old_req) = next(iter(requests))  # O(1): an OrderedDict
            self._end(old_instance, old_req, now)
            self._dropped_requests.inc()
            self._warn(now)

    def _process_record(
        self,
        instance_id: int,
        inst: _Instance,
        record: BlockAllocationRecord,
        block_size: int | None,
        now: float,
    ) -> None:
        sampled = self.sampler.sampled_block
        blocks = inst.blocks
        hists = inst.hists
        requests = self._requests
        req = record.req_id
        req_key = (instance_id, req)
        if req_key in requests:  # still reporting: now the most recent
            requests.move_to_end(req_key)
        tokens = record.new_token_ids
        whole = hash(tuple(tokens)) if not block_size else 0
        for i, block_id in enumerate(record.new_block_ids):
            if not sampled(instance_id, block_id):
                continue
            fingerprint = (
                whole if not block_size else hash(tuple(tokens[i * block_size : (i + 1) * block_size]))
            )
            block = blocks.get(block_id)
            if block is not None:
                if req in block.owners:
                    continue  # decode continuation
                if block.fingerprint == fingerprint:
                    if block.owners:  # prefix sharing with a live request
                        block.owners.add(req)
                        block.last_access = now
                    else:  # true reuse after release
                        hists.reuse_gap.observe(now - block.last_use)
                        block.owners.add(req)
                        block.last_use = block.last_access = now
                    requests.setdefault(req_key, set()).add(block_id)
                    continue
                hists.lifetime.observe(now - block.allocated_at)
                hists.idle_before_evict.observe(now - block.last_access)
                self._release(instance_id, block, block_id)
            blocks[block_id] = _Block(fingerprint, now, now, now, {req})
            requests.setdefault(req_key, set()).add(block_id)

    def _release(self, instance_id: int, block: _Block, block_id: int) -> None:
        """Forget the evicted content's owners (their request no longer holds this block)."""
        for owner in block.owners:
            held = self._requests.get((instance_id, owner))
            if held is not None:
                held.discard(block_id)
                if not held:
                    del self._requests[(instance_id, owner)]

    def _on_end_session(self, event: Event) -> None:
        md = cast(MpVllmEndSession, event.metadata)
        now = event.timestamp
        assert now is not None
        self._end(md.instance_id, md.request_id, now)

    def _on_unregistered(self, event: Event) -> None:
        """Drop the instance's block and request state (its memory is gone), but keep its
        series: a finished engine's histograms must still reach the next scrape. Series go
        only at the instance cap, least recently reported first."""
        instance_id = cast(InstanceUnregistered, event.metadata).instance_id
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.blocks.clear()
        for key in [k for k in self._requests if k[0] == instance_id]:
            del self._requests[key]

    def _end(self, instance_id: int, req: str, now: float) -> None:
        held = self._requests.pop((instance_id, req), ())
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        for block_id in held:
            block = inst.blocks.get(block_id)
            if block is not None and req in block.owners:
                block.owners.discard(req)
                if not block.owners:
                    block.last_access = now


__all__ = ["DEFAULT_MAX_INSTANCES", "DEFAULT_MAX_REQUESTS", "L0LifecycleSubscriber"]
