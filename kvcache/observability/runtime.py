"""``init_observability``: build the bus and every enabled subscriber and exporter from config.

The one place that knows which subscribers exist, so entry points (the daemon, a
``CacheEngine`` created by a library user) get the whole observability side with one call
and tear it down with one ``shutdown()``. Nothing here is a module-level singleton: the
returned ``Observability`` owns its registry, bus, endpoint and tracer provider.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.registry import CollectorRegistry

from kvcache.observability.bus import EventBus, EventSubscriber, NullEventBus
from kvcache.observability.config import ObservabilityConfig
from kvcache.observability.prometheus import PrometheusEndpoint

logger = logging.getLogger(__name__)


@dataclass
class Observability:
    """Everything ``init_observability`` started; ``shutdown()`` stops it all, once."""

    config: ObservabilityConfig
    bus: EventBus | NullEventBus
    registry: CollectorRegistry
    endpoint: PrometheusEndpoint | None = None
    tracer_provider: Any = None
    subscribers: list[EventSubscriber] = field(default_factory=list)
    _closed: bool = False

    def shutdown(self) -> None:
        """Drain the bus, shut subscribers down, flush spans, close the endpoint."""
        if self._closed:
            return
        self._closed = True
        self.bus.stop()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.endpoint is not None:
            self.endpoint.stop()

    def __enter__(self) -> Observability:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _subscribers(config: ObservabilityConfig, registry: CollectorRegistry) -> list[Any]:
    from kvcache.observability import subscribers as s

    subs: list[Any] = []
    if config.metrics:
        subs += [
            s.EngineMetricsSubscriber(registry),
            s.OffloadMetricsSubscriber(registry),
            s.L1MetricsSubscriber(registry),
            s.L2MetricsSubscriber(registry),
            s.TierMetricsSubscriber(registry),
            s.AdmissionMetricsSubscriber(registry),
        ]
    if config.lifecycle_metrics:
        subs += [
            s.L0LifecycleSubscriber(config.metrics_sample_rate, registry=registry),
            s.L1LifecycleSubscriber(
                config.metrics_sample_rate, config.max_evict_reuse_wait, registry=registry
            ),
        ]
    if config.logging:
        subs.append(s.LoggingSubscriber())
    return subs


def init_observability(
    config: ObservabilityConfig, registry: CollectorRegistry | None = None
) -> Observability:
    """Build, wire and start everything ``config`` enables.

    ``registry`` defaults to a fresh ``CollectorRegistry`` (not the process-global one), so
    the endpoint serves exactly the metrics listed in METRICS.md. The endpoint is started
    when any metrics are on and ``prometheus_port`` is not None.
    """
    registry = CollectorRegistry() if registry is None else registry
    if not config.enabled:
        return Observability(config, NullEventBus(), registry)
    bus = EventBus(config.event_bus_queue_size, registry=registry)
    obs = Observability(config, bus, registry)
    try:
        obs.subscribers = _subscribers(config, registry)
        if config.tracing:
            from kvcache.observability.otel import build_tracer_provider
            from kvcache.observability.subscribers.tracing import TracingSubscriber

            assert config.traces_url is not None
            obs.tracer_provider = build_tracer_provider(config.traces_url)
            obs.subscribers.append(TracingSubscriber(obs.tracer_provider))
        for subscriber in obs.subscribers:
            bus.register_subscriber(subscriber)
        if (config.metrics or config.lifecycle_metrics) and config.prometheus_port is not None:
            obs.endpoint = PrometheusEndpoint(config.prometheus_host, config.prometheus_port, registry)
            logger.info("serving Prometheus metrics on %s", obs.endpoint.url)
        bus.start()
    except BaseException:
        obs.shutdown()
        raise
    return obs


__all__ = ["Observability", "init_observability"]
