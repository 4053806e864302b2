"""Prometheus counters, gauges and histograms: engine operations, transfers, L1, L2, tokens per
tier, and the daemon's refusals per principal."""

from kvcache.observability.subscribers.metrics.admission import AdmissionMetricsSubscriber
from kvcache.observability.subscribers.metrics.engine import EngineMetricsSubscriber
from kvcache.observability.subscribers.metrics.l1 import L1MetricsSubscriber
from kvcache.observability.subscribers.metrics.l2 import L2MetricsSubscriber
from kvcache.observability.subscribers.metrics.offload import OffloadMetricsSubscriber
from kvcache.observability.subscribers.metrics.tiers import TierMetricsSubscriber

__all__ = [
    "AdmissionMetricsSubscriber",
    "EngineMetricsSubscriber",
    "L1MetricsSubscriber",
    "L2MetricsSubscriber",
    "OffloadMetricsSubscriber",
    "TierMetricsSubscriber",
]
