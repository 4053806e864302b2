"""Sampled block (L0, GPU) and chunk (L1, CPU) lifecycle histograms; costly, so separate."""

from kvcache.observability.subscribers.lifecycle.l0 import L0LifecycleSubscriber
from kvcache.observability.subscribers.lifecycle.l1 import L1LifecycleSubscriber

__all__ = ["L0LifecycleSubscriber", "L1LifecycleSubscriber"]
