"""Real Redis servers on free loopback ports, started and killed by the tests: one server per
test, and Redis Clusters of six ``redis-server`` processes (3 masters + 3 replicas)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcache.testing.redis_cluster_local import LocalRedisCluster
from kvcache.testing.redis_local import LocalRedis
from tests.helpers import start_cluster


@pytest.fixture()
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[LocalRedisCluster]:
    """One cluster for a module's tests that leave every node running."""
    cluster = start_cluster()
    yield cluster
    cluster.close()


@pytest.fixture()
def fresh_cluster() -> Iterator[LocalRedisCluster]:
    """A cluster of the test's own, for tests that kill a node."""
    cluster = start_cluster()
    yield cluster
    cluster.close()
