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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import REGISTRY
from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import BlockAllocationRecord, Event, EventType
from kvcache.observability.instruments import LIFETIME_SECONDS, Family, Histogram, MetricSet
from kvcache.observability.sampling import Sampler

LABELS = ("instance_id", "model_name")
BlockKey = tuple[int, int]  # (instance_id, block_id)


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


class L0LifecycleSubscriber(EventSubscriber):
    """Block lifetime, idle-before-evict and reuse-gap histograms per instance and model."""

    def __init__(
        self,
        sample_rate: float = 0.01,
        registry: CollectorRegistry | None = REGISTRY,
        instances: Iterable[tuple[int, str]] = (),
        max_requests: int = 1 << 16,
    ) -> None:
        """``max_requests``: requests followed at once; an engine that never reports their
        end (a bug, a crash) cannot grow this state: the oldest is treated as ended."""
        self.sampler = Sampler(sample_rate)
        self.max_requests = max_requests
        self.requests_dropped = 0
        m = self.metrics = MetricSet()
        self._lifetime = m.add(
            "kvcache_l0_block_lifetime_seconds",
            "GPU block: allocation of its content to its eviction (sampled blocks).",
            "histogram", LABELS, LIFETIME_SECONDS,
        )
        self._idle = m.add(
            "kvcache_l0_block_idle_before_evict_seconds",
            "GPU block: last access to eviction (sampled blocks).",
            "histogram", LABELS, LIFETIME_SECONDS,
        )
        self._reuse_gap = m.add(
            "kvcache_l0_block_reuse_gap_seconds",
            "GPU block: time between uses of the same content by later requests (sampled).",
            "histogram", LABELS, LIFETIME_SECONDS,
        )
        self._hists: dict[tuple[int, str], _Histograms] = {}
        self._blocks: dict[BlockKey, _Block] = {}
        self._by_request: dict[tuple[int, str], set[int]] = {}
        for instance_id, model_name in instances:
            self._histograms(instance_id, model_name)
        if registry is not None:
            m.register(registry)

    @property
    def tracked_requests(self) -> int:
        """Requests followed now (bounded by ``max_requests``)."""
        return len(self._by_request)

    @property
    def tracked_blocks(self) -> int:
        """Blocks currently in the shadow map (the subscriber's memory, in entries)."""
        return len(self._blocks)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.MP_VLLM_BLOCK_ALLOCATION: self._on_allocation,
            EventType.MP_VLLM_END_SESSION: self._on_end_session,
        }

    def _histograms(self, instance_id: int, model_name: str) -> _Histograms:
        hists = self._hists.get((instance_id, model_name))
        if hists is None:
            values = (str(instance_id), model_name)
            fams: tuple[Family, Family, Family] = (self._lifetime, self._idle, self._reuse_gap)
            hists = _Histograms(*(f.histogram(*values) for f in fams))
            self._hists[(instance_id, model_name)] = hists
        return hists

    def _on_allocation(self, event: Event) -> None:
        md = event.metadata
        instance_id: int = md["instance_id"]
        model_name: str = md.get("model_name", "")
        block_size: int | None = md.get("block_size")
        records: list[BlockAllocationRecord] = md["records"]
        hists = self._histograms(instance_id, model_name)
        now = event.timestamp
        assert now is not None
        for record in records:
            self._process_record(instance_id, record, block_size, now, hists)
        while len(self._by_request) > self.max_requests:  # oldest first (insertion order)
            (old_instance, old_req) = next(iter(self._by_request))
            self._end(old_instance, old_req, now)
            self.requests_dropped += 1

    def _process_record(
        self,
        instance_id: int,
        record: BlockAllocationRecord,
        block_size: int | None,
        now: float,
        hists: _Histograms,
    ) -> None:
        sampled = self.sampler.sampled_block
        req = record.req_id
        tokens = record.new_token_ids
        whole = hash(tuple(tokens)) if not block_size else 0
        for i, block_id in enumerate(record.new_block_ids):
            if not sampled(instance_id, block_id):
                continue
            fingerprint = (
                whole if not block_size
                else hash(tuple(tokens[i * block_size:(i + 1) * block_size]))
            )
            key = (instance_id, block_id)
            block = self._blocks.get(key)
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
                    self._by_request.setdefault((instance_id, req), set()).add(block_id)
                    continue
                hists.lifetime.observe(now - block.allocated_at)
                hists.idle_before_evict.observe(now - block.last_access)
                self._release(instance_id, block, block_id)
            self._blocks[key] = _Block(fingerprint, now, now, now, {req})
            self._by_request.setdefault((instance_id, req), set()).add(block_id)

    def _release(self, instance_id: int, block: _Block, block_id: int) -> None:
        """Forget the evicted content's owners (their request no longer holds this block)."""
        for owner in block.owners:
            held = self._by_request.get((instance_id, owner))
            if held is not None:
                held.discard(block_id)
                if not held:
                    del self._by_request[(instance_id, owner)]

    def _on_end_session(self, event: Event) -> None:
        md = event.metadata
        now = event.timestamp
        assert now is not None
        self._end(md["instance_id"], md["request_id"], now)

    def _end(self, instance_id: int, req: str, now: float) -> None:
        for block_id in self._by_request.pop((instance_id, req), ()):
            block = self._blocks.get((instance_id, block_id))
            if block is not None and req in block.owners:
                block.owners.discard(req)
                if not block.owners:
                    block.last_access = now


__all__ = ["L0LifecycleSubscriber"]
