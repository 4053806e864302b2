"""A prefill/decode split across hosts: two real daemons (as on two machines) share a real
3 + 3 Redis Cluster L2. The decode side's retrieve is issued before the prefill side's store;
it waits (``await_chunks``) while its daemon polls L2 for the chunks the other daemon writes
through (nothing tells a daemon that a chunk reached L2 from elsewhere), and copies them once
they are there: the same bytes the prefill side stored."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.testing.redis_cluster_local import LocalRedisCluster
from tests.helpers import sealed_redis_args

CS, BS, CHUNKS = 16, 4, 8
TOKENS, BLOCKS = [5000 + t for t in range(CS * CHUNKS)], list(range(CS * CHUNKS // BS))


@pytest.fixture(scope="module")
def daemons(
    shared_cluster: LocalRedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    args = ["--chunk-size", str(CS), "--l1-size-gb", "0.2", "--l2-redis-url", shared_cluster.url,
            *sealed_redis_args(tmp_path_factory.mktemp("disagg"))]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # start both at once: each takes seconds to import
        fa, fb = pool.submit(DaemonProcess, args), pool.submit(DaemonProcess, args)
        a, b = fa.result(), fb.result()
    try:
        yield a, b
    finally:
        for d in (a, b):
            d.kill()
            d.remove_runtime_dir()


def _cache(seed: int) -> list:  # type: ignore[type-arg]
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=len(BLOCKS),
                                    block_size=BS, num_heads=2, head_size=8, seed=seed))  # fmt: skip


def test_decode_on_another_daemon_waits_for_the_prefill_write_through(
    daemons: tuple[DaemonProcess, DaemonProcess],
) -> None:
    prefill_daemon, decode_daemon = daemons
    kv_p, kv_c = _cache(1), _cache(2)
    expected = clone_caches(kv_c)
    with KVCacheClient(prefill_daemon.endpoint, 1, "m", timeout_s=20) as producer, \
         KVCacheClient(decode_daemon.endpoint, 2, "m", timeout_s=20) as consumer:  # fmt: skip
        producer.register_kv_caches(kv_p)
        consumer.register_kv_caches(kv_c)
        waiting = consumer.retrieve_reply_async(TOKENS, BLOCKS, awaited=(CHUNKS, 15_000), request_id="dec")
        assert consumer.ping() and not waiting.done()  # nothing stored anywhere yet
        assert caches_equal(kv_c, expected)
        assert producer.store(TOKENS, BLOCKS).stored_chunks == CHUNKS
        assert waiting.result(timeout=20).retrieved_tokens == CS * CHUNKS
        assert caches_equal(kv_c, kv_p)
