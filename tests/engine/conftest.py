"""A real redis-server per test module, on a free loopback port (killed and restarted by tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcache.testing.redis_local import LocalRedis


@pytest.fixture()
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server
