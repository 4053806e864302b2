"""Fixtures for observability tests: a fresh registry per test and a started bus."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def bus(registry: CollectorRegistry) -> Iterator[EventBus]:
    b = EventBus(max_queue_size=100_000, registry=registry)
    b.start()
    yield b
    b.stop()
