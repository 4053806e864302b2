"""ObservabilityConfig and its command-line flags."""

from __future__ import annotations

import argparse

import pytest

from kvcache.observability.config import ObservabilityConfig, add_observability_args


def parse(*argv: str) -> ObservabilityConfig:
    parser = add_observability_args(argparse.ArgumentParser())
    return ObservabilityConfig.from_args(parser.parse_args(list(argv)))


def test_defaults() -> None:
    cfg = parse()
    assert cfg == ObservabilityConfig()
    assert (cfg.enabled, cfg.metrics, cfg.lifecycle_metrics, cfg.logging, cfg.tracing) == (
        True,
        True,
        True,
        True,
        False,
    )
    assert (cfg.prometheus_host, cfg.prometheus_port) == ("127.0.0.1", 9259)
    assert cfg.metrics_sample_rate == 0.01
    assert cfg.event_bus_queue_size == 10_000


def test_every_flag() -> None:
    cfg = parse(
        "--disable-observability",
        "--disable-metrics",
        "--disable-logging",
        "--disable-lifecycle-metrics",
        "--enable-tracing",
        "--otlp-endpoint",
        "http://c:4318",
        "--prometheus-host",
        "0.0.0.0",
        "--prometheus-port",
        "9191",
        "--metrics-sample-rate",
        "0.5",
        "--event-bus-queue-size",
        "77",
    )
    assert not (cfg.enabled or cfg.metrics or cfg.logging or cfg.lifecycle_metrics)
    assert cfg.tracing and cfg.otlp_endpoint == "http://c:4318"
    assert cfg.traces_url == "http://c:4318/v1/traces"
    assert (cfg.prometheus_host, cfg.prometheus_port) == ("0.0.0.0", 9191)
    assert cfg.metrics_sample_rate == 0.5 and cfg.event_bus_queue_size == 77


def test_tracing_requires_an_endpoint() -> None:
    with pytest.raises(ValueError, match="--enable-tracing requires --otlp-endpoint"):
        parse("--enable-tracing")


@pytest.mark.parametrize("rate", ["0", "-1", "1.01", "abc"])
def test_sample_rate_range_is_enforced_by_the_parser(rate: str) -> None:
    with pytest.raises(SystemExit):
        parse("--metrics-sample-rate", rate)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="metrics-sample-rate"):
        ObservabilityConfig(metrics_sample_rate=0.0)
    with pytest.raises(ValueError, match="queue-size"):
        ObservabilityConfig(event_bus_queue_size=0)
    with pytest.raises(ValueError, match="prometheus-port"):
        ObservabilityConfig(prometheus_port=70000)
    with pytest.raises(ValueError, match="http"):
        ObservabilityConfig(tracing=True, otlp_endpoint="collector:4318")
    assert ObservabilityConfig(otlp_endpoint="http://h/custom").traces_url == "http://h/custom"
