"""The /metrics endpoint: exact bind address, real HTTP scrape, parser and promtool checks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcache.observability.bus import EventBus
from kvcache.observability.event import BlockAllocationRecord, EventType
from kvcache.observability.prometheus import start_prometheus_endpoint
from kvcache.observability.subscribers import (
    EngineMetricsSubscriber,
    L0LifecycleSubscriber,
    L1LifecycleSubscriber,
    L1MetricsSubscriber,
    L2MetricsSubscriber,
    OffloadMetricsSubscriber,
)
from tests.helpers import event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def populated(registry: CollectorRegistry) -> EventBus:
    bus = EventBus(registry=registry)
    for sub in (
        EngineMetricsSubscriber(registry),
        OffloadMetricsSubscriber(registry),
        L1MetricsSubscriber(registry),
        L2MetricsSubscriber(registry),
        L0LifecycleSubscriber(1.0, registry),
        L1LifecycleSubscriber(1.0, 300, registry),
    ):
        bus.register_subscriber(sub)
    bus.start()
    inst = {"instance_id": 1, "model_name": 'we"ird\\name'}
    md = {**inst, "device": "cpu"}
    bus.publish(
        event(
            EventType.MP_STORE_END,
            {**md, "num_tokens": 256, "num_bytes": 1 << 20, "transfer_seconds": 0.001},
            "s",
            1.0,
        )
    )
    bus.publish(
        event(
            EventType.MP_VLLM_BLOCK_ALLOCATION,
            {**inst, "records": [BlockAllocationRecord("r", [1], [1, 2])]},
            "",
            1.0,
        )
    )
    bus.publish(event(EventType.L1_WRITE_FINISHED, {"keys": [1], "num_bytes": 10}, "", 1.0))
    bus.publish(event(EventType.L1_KEYS_EVICTED, {"keys": [1], "num_bytes": 10}, "", 9.0))
    bus.publish(event(EventType.L2_LOAD_FAILED, {"backend": "disk", "keys": [1], "reason": "timeout"}))
    assert bus.flush(5)
    return bus


def test_serves_on_exactly_the_configured_port() -> None:
    registry = CollectorRegistry()
    bus = populated(registry)
    port = free_port()
    endpoint = start_prometheus_endpoint("127.0.0.1", port, registry)
    try:
        assert endpoint.port == port
        assert endpoint.url == f"http://127.0.0.1:{port}/metrics"
        text = scrape(endpoint.url)
    finally:
        endpoint.stop()
        endpoint.stop()  # idempotent
        bus.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    store = families["kvcache_store_requests"]
    (sample,) = store.samples
    assert sample.value == 1 and sample.labels["model_name"] == 'we"ird\\name'
    lifetime = families["kvcache_l1_chunk_lifetime_seconds"]
    assert {s.name for s in lifetime.samples} >= {
        "kvcache_l1_chunk_lifetime_seconds_count",
        "kvcache_l1_chunk_lifetime_seconds_bucket",
    }
    assert "kvcache_event_bus_queue_depth" in families
    with pytest.raises(OSError):  # the socket is closed after stop()
        scrape(endpoint.url)


def test_port_zero_picks_a_free_port() -> None:
    registry = CollectorRegistry()
    with start_prometheus_endpoint("127.0.0.1", 0, registry) as endpoint:
        assert endpoint.port > 0
        scrape(endpoint.url)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian 'prometheus') missing")
def test_promtool_accepts_the_exposition() -> None:
    registry = CollectorRegistry()
    bus = populated(registry)
    with start_prometheus_endpoint("127.0.0.1", 0, registry) as endpoint:
        text = scrape(endpoint.url)
    bus.stop()
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr
