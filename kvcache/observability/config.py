"""Observability settings and the command-line flags a daemon reuses to set them.

One frozen record, validated on construction, so a bad setting fails at startup with a
message naming the flag, never later on the data path.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlparse

DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
# Not Prometheus' own 9090: a host that runs Prometheus next to the daemon would clash. 9259 is in
# the exporters' range of Prometheus' default port allocations (wiki "Default port allocations"),
# whose 9100-9999 block is fully allocated: 9259 was reserved for a PCP exporter that never used
# it (PCP serves its metrics on 44323), and nothing that runs on an inference host (node 9100,
# DCGM 9400, Redis exporter 9121) sits on it.
DEFAULT_PROMETHEUS_PORT = 9259
DEFAULT_SAMPLE_RATE = 0.01
DEFAULT_QUEUE_SIZE = 10_000


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """What ``init_observability`` builds. ``prometheus_port=None`` serves no endpoint."""

    enabled: bool = True
    metrics: bool = True
    lifecycle_metrics: bool = True
    logging: bool = True
    tracing: bool = False
    otlp_endpoint: str | None = None
    prometheus_host: str = DEFAULT_PROMETHEUS_HOST
    prometheus_port: int | None = DEFAULT_PROMETHEUS_PORT
    metrics_sample_rate: float = DEFAULT_SAMPLE_RATE
    event_bus_queue_size: int = DEFAULT_QUEUE_SIZE
    max_evict_reuse_wait: float = 300.0

    def __post_init__(self) -> None:
        if self.tracing and not self.otlp_endpoint:
            raise ValueError("--enable-tracing requires --otlp-endpoint (an OTLP/HTTP URL)")
        if self.otlp_endpoint is not None and urlparse(self.otlp_endpoint).scheme not in (
            "http",
            "https",
        ):
            raise ValueError(f"--otlp-endpoint must be an http(s) URL, got {self.otlp_endpoint!r}")
        if not 0.0 < self.metrics_sample_rate <= 1.0:
            raise ValueError(f"--metrics-sample-rate must be in (0, 1], got {self.metrics_sample_rate}")
        if self.event_bus_queue_size < 1:
            raise ValueError(f"--event-bus-queue-size must be >= 1, got {self.event_bus_queue_size}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"--prometheus-port must be in [0, 65535], got {self.prometheus_port}")
        if self.max_evict_reuse_wait <= 0:
            raise ValueError(f"max_evict_reuse_wait must be > 0, got {self.max_evict_reuse_wait}")

    @property
    def traces_url(self) -> str | None:
        """The OTLP/HTTP traces URL: the endpoint, with ``/v1/traces`` added if it has no path."""
        if self.otlp_endpoint is None:
            return None
        if urlparse(self.otlp_endpoint).path in ("", "/"):
            return self.otlp_endpoint.rstrip("/") + "/v1/traces"
        return self.otlp_endpoint

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> ObservabilityConfig:
        """Build from flags added by ``add_observability_args``; raises ``ValueError``."""
        return cls(
            enabled=not ns.disable_observability,
            metrics=not ns.disable_metrics,
            lifecycle_metrics=not ns.disable_lifecycle_metrics,
            logging=not ns.disable_logging,
            tracing=ns.enable_tracing,
            otlp_endpoint=ns.otlp_endpoint,
            prometheus_host=ns.prometheus_host,
            prometheus_port=ns.prometheus_port,
            metrics_sample_rate=ns.metrics_sample_rate,
            event_bus_queue_size=ns.event_bus_queue_size,
        )


def _sample_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < rate <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {rate}")
    return rate


def positive_int(text: str) -> int:
    """argparse type for counts and sizes (shared by every flag group)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_observability_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the observability flags (in their own group) to ``parser``; returns it."""
    g = parser.add_argument_group("observability")
    g.add_argument(
        "--disable-observability",
        action="store_true",
        help="No event bus at all: publishing costs one empty call.",
    )
    g.add_argument(
        "--disable-metrics", action="store_true", help="No engine/transfer/L1/L2 metrics subscribers."
    )
    g.add_argument(
        "--disable-lifecycle-metrics",
        action="store_true",
        help="No L0 block / L1 chunk lifecycle histograms.",
    )
    g.add_argument("--disable-logging", action="store_true", help="No logging subscriber.")
    g.add_argument(
        "--enable-tracing", action="store_true", help="Export OpenTelemetry spans (requires --otlp-endpoint)."
    )
    g.add_argument(
        "--otlp-endpoint",
        default=None,
        help="OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318 (/v1/traces is added).",
    )
    g.add_argument(
        "--prometheus-host",
        default=DEFAULT_PROMETHEUS_HOST,
        help="Address the /metrics endpoint binds to (default %(default)s); "
        "0.0.0.0 or another non-loopback address lets other hosts scrape it "
        "and is logged as a warning.",
    )
    g.add_argument(
        "--prometheus-port",
        type=int,
        default=DEFAULT_PROMETHEUS_PORT,
        help="Port of the /metrics endpoint (default %(default)s; 0 = any free).",
    )
    g.add_argument(
        "--metrics-sample-rate",
        type=_sample_rate,
        default=DEFAULT_SAMPLE_RATE,
        help="Fraction of blocks/chunks the lifecycle metrics track, in (0, 1] (default %(default)s).",
    )
    g.add_argument(
        "--event-bus-queue-size",
        type=positive_int,
        default=DEFAULT_QUEUE_SIZE,
        help="Events the bus buffers before dropping new ones (default %(default)s).",
    )
    return parser


__all__ = ["ObservabilityConfig", "add_observability_args"]
