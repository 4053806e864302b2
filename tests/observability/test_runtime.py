"""init_observability wires bus, subscribers and endpoint from config and tears them down."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache.observability import (
    EventBus,
    EventType,
    NullEventBus,
    ObservabilityConfig,
    init_observability,
)
from tests.helpers import event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_full_wiring_serves_metrics_on_the_configured_port() -> None:
    port = free_port()
    obs = init_observability(ObservabilityConfig(prometheus_port=port, metrics_sample_rate=1.0))
    try:
        assert isinstance(obs.bus, EventBus) and obs.bus.running
        assert obs.endpoint is not None and obs.endpoint.port == port
        names = {type(s).__name__ for s in obs.subscribers}
        assert names == {
            "EngineMetricsSubscriber",
            "OffloadMetricsSubscriber",
            "L1MetricsSubscriber",
            "L2MetricsSubscriber",
            "TierMetricsSubscriber",
            "AdmissionMetricsSubscriber",
            "L0LifecycleSubscriber",
            "L1LifecycleSubscriber",
            "LoggingSubscriber",
        }
        obs.bus.publish(
            event(
                EventType.MP_LOOKUP_END,
                {
                    "instance_id": 1,
                    "model_name": "m",
                    "num_tokens": 10,
                    "hit_tokens": 4,
                    "l1_hit_tokens": 4,
                    "l2_hit_tokens": 0,
                },
            )
        )
        assert obs.bus.flush(5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (hit,) = fams["kvcache_lookup_hit_tokens"].samples
        assert hit.value == 4
    finally:
        obs.shutdown()
    obs.shutdown()  # idempotent
    assert not obs.bus.running
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_disabled_observability_is_a_null_bus() -> None:
    with init_observability(ObservabilityConfig(enabled=False)) as obs:
        assert isinstance(obs.bus, NullEventBus)
        assert obs.endpoint is None and obs.subscribers == []


def test_switches_select_subscribers() -> None:
    cfg = ObservabilityConfig(metrics=False, lifecycle_metrics=False, prometheus_port=0)
    with init_observability(cfg) as obs:
        assert [type(s).__name__ for s in obs.subscribers] == ["LoggingSubscriber"]
        assert obs.endpoint is None  # no metrics: nothing to serve
    cfg = ObservabilityConfig(logging=False, lifecycle_metrics=False, prometheus_port=None)
    with init_observability(cfg) as obs:
        assert "LoggingSubscriber" not in {type(s).__name__ for s in obs.subscribers}
        assert "L0LifecycleSubscriber" not in {type(s).__name__ for s in obs.subscribers}
        assert obs.endpoint is None


def test_tracing_adds_the_tracing_subscriber() -> None:
    pytest.importorskip("opentelemetry.sdk")
    cfg = ObservabilityConfig(tracing=True, otlp_endpoint="http://127.0.0.1:9/", prometheus_port=None)
    with init_observability(cfg) as obs:
        assert obs.tracer_provider is not None
        assert "TracingSubscriber" in {type(s).__name__ for s in obs.subscribers}


def test_busy_port_fails_cleanly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError):
            init_observability(ObservabilityConfig(prometheus_port=port))
