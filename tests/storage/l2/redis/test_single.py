"""Redis L2 against a real redis-server: round trip, corruption, and the server dying."""

from __future__ import annotations

import msgspec
import pytest
import redis
import torch

from kvcache.errors import CorruptChunkError, StorageError
from kvcache.observability.event import ChunkIdentity, EventType
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.storage.l2.base import failure_reason
from kvcache.storage.l2.redis.single import RedisL2Adapter
from kvcache.testing.redis_local import LocalRedis
from tests.helpers import RecordingSink


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 16, 32, generator=g).to(torch.float16)


def adapter(server: LocalRedis, **kw: object) -> RedisL2Adapter:
    return RedisL2Adapter(server.url, socket_timeout_s=0.5, connect_timeout_s=0.5, **kw)  # type: ignore[arg-type]


def test_round_trip(redis_server: LocalRedis) -> None:
    a = adapter(redis_server, key_prefix="t:", ttl_s=100)
    t = chunk(1)
    assert a.store(1 << 100, t) > t.numel() * 2
    assert a.contains([1 << 100, 5]) == [True, False] and a.contains([]) == []
    out = torch.empty_like(t)
    assert a.load(1 << 100, out) and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    assert not a.load(5, out)
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.exists(f"t:{1 << 100:032x}") and 0 < raw.ttl(f"t:{1 << 100:032x}") <= 100
    assert a.delete([1 << 100, 5]) == 1 and a.delete([]) == 0
    assert a.info()["backend"] == "redis"
    a.close()


def test_corrupt_value_is_a_miss_and_deleted(redis_server: LocalRedis) -> None:
    a = adapter(redis_server)
    t = chunk(2)
    a.store(9, t)
    raw = redis.Redis.from_url(redis_server.url)
    name = f"kvcache:{9:032x}"
    value = raw.get(name)
    assert value is not None
    raw.set(name, value[:-10])  # truncated
    with pytest.raises(CorruptChunkError):
        a.load(9, torch.empty_like(t))
    assert not raw.exists(name)
    raw.set(name, b"garbage")
    with pytest.raises(CorruptChunkError):
        a.load(9, torch.empty_like(t))


def test_server_down_raises_tagged_storage_error(redis_server: LocalRedis) -> None:
    a = adapter(redis_server)
    a.store(1, chunk(1))
    redis_server.stop()
    for op in (lambda: a.store(2, chunk(2)), lambda: a.load(1, chunk(0)), lambda: a.contains([1])):
        with pytest.raises(StorageError) as info:
            op()
        assert failure_reason(info.value) == "unavailable"
    redis_server.start()  # same port, empty (no persistence)
    assert a.contains([1]) == [False]
    a.store(2, chunk(2))
    assert a.contains([2]) == [True]


def test_redacted_url() -> None:
    a = RedisL2Adapter("redis://user:secret@127.0.0.1:1/0")
    assert "secret" not in a.info()["url"]
    a.close()


def test_batches_are_per_item_and_a_full_server_is_full(redis_server: LocalRedis) -> None:
    a = adapter(redis_server)
    chunks = [chunk(i) for i in range(4)]
    sizes: list[int] = []
    assert a.store_many([(k, t, sizes.append) for k, t in enumerate(chunks)]) == sizes
    bad = torch.empty(4, 4).t()  # not contiguous: that item fails, the others are stored
    res = a.store_many([(10, chunks[0], None), (11, bad, None)])
    assert isinstance(res[0], int) and failure_reason(res[1]) == "io"  # type: ignore[arg-type]
    outs = [torch.empty_like(t) for t in chunks]
    assert a.load_many([*zip(range(4), outs, strict=True), (99, outs[0].clone())]) == [True] * 4 + [False]
    pairs = zip(outs, chunks, strict=True)
    assert all(torch.equal(o.view(torch.uint8), t.view(torch.uint8)) for o, t in pairs)
    assert a.contains_many([0, 99]) == [True, False]
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", max(1 << 20, int(raw.info("memory")["used_memory"]) + (64 << 10)))
    big = torch.zeros(1 << 19, dtype=torch.uint8)  # 512 KiB: beyond what is left
    (full,) = a.store_many([(20, big, None)])
    assert isinstance(full, StorageError) and failure_reason(full) == "full"
    assert a.load(0, outs[0])  # reads still work
    a.close()


def test_a_chunk_keeps_the_identity_it_was_written_with(redis_server: LocalRedis) -> None:
    """A daemon that loads a chunk another one wrote learns how its writer announced it
    (``L2_LOAD_FINISHED`` ``identities``), so both announce it under the same hashes."""
    ident = ChunkIdentity(parent_key=(7).to_bytes(16, "little"), token_ids=list(range(16)),
                          block_hashes=[11, 12], block_size=8, parent_block_hash=10)  # fmt: skip
    writer = adapter(redis_server)
    assert writer.keeps_meta
    sent = {1: chunk(1), 2: chunk(2)}
    assert all(
        isinstance(n, int)
        for n in writer.store_many_with_meta(
            [(k, t, None) for k, t in sent.items()], [msgspec.msgpack.encode(ident), b""]
        )
    )
    sink = RecordingSink()
    reader = AsyncL2(adapter(redis_server), bus=sink)
    try:
        got = {k: torch.empty_like(t) for k, t in sent.items()}
        done: list[bool] = []
        for k, out in got.items():
            assert reader.submit_load(k, out, done.append)
        assert reader.flush(10) and done == [True, True]
        assert all(torch.equal(got[k].view(torch.uint8), sent[k].view(torch.uint8)) for k in sent)
        loaded = {e.metadata.keys[0]: e.metadata.identities for e in sink.of(EventType.L2_LOAD_FINISHED)}
        assert loaded == {1: [ident], 2: []}  # a chunk written without one: no identities
    finally:
        reader.close()
        writer.close()
