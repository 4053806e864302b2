"""What vLLM carries between the connector's halves each step, as vLLM's metadata types.

Separate from ``connector.py`` because it is the halves' whole wire: in vLLM's multiprocess
mode the scheduler half and the workers share nothing else (besides the daemon). The plan goes
down pickled (``KVCacheMetadata``); what the workers could not store, and which step's loads
failed, come back in the model runner's output (``KVCacheWorkerMeta``), merged across
tensor-parallel ranks by vLLM before the scheduler half reads it.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcache.integrations.vllm.plan import StepPlan


class KVCacheMetadata(KVConnectorMetadata):
    """The step plan as vLLM's metadata type (pickled to the workers)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: requests whose chunks are stored only up to a point the
    plan assumed higher (a store cut short after a failed load, or a failed store), the
    step whose load failed (so later plans tell the workers vLLM is recomputing it), and the
    requests whose asynchronous load failed in the output that reports them received (their
    next admission recomputes instead of loading again: see ``KVCacheConnector``)."""

    def __init__(
        self, not_stored: dict[str, int], failed_step: int = -1, failed_async: frozenset[str] = frozenset()
    ) -> None:
        self.not_stored = not_stored
        self.failed_step = failed_step
        self.failed_async = failed_async

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: a chunk is stored only if every rank stored its part; a
        load failed if it failed on any rank."""
        if isinstance(other, KVCacheWorkerMeta):
            merged = dict(self.not_stored)
            for req, upto in other.not_stored.items():
                merged[req] = min(upto, merged.get(req, upto))
            return KVCacheWorkerMeta(
                merged, max(self.failed_step, other.failed_step), self.failed_async | other.failed_async
            )
        return self


__all__ = ["KVCacheMetadata", "KVCacheWorkerMeta"]
