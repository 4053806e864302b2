"""KVEventsSubscriber on a real EventBus: the batches each bus event turns into."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvcache.keys import fold64
from kvcache.kv_events.messages import EventBatch
from kvcache.kv_events.publisher import EventPublisher
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.observability.bus import EventBus
from kvcache.observability.event import ChunkIdentity, EventType
from tests.helpers import event

CS = 32
K1, K2, K3 = (1 << 100) + 1, (2 << 100) + 2, (3 << 100) + 3


class ListPublisher(EventPublisher):
    """An in-memory publisher: a real implementation of the ABC that keeps what it gets."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.closed = False

    def publish(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        self.closed = True

    def events(self) -> list[tuple[str, ...]]:
        out = []
        for b in self.batches:
            for e in b.events:
                kind = type(e).__name__
                if kind == "BlockStored":
                    out.append(
                        (
                            kind,
                            e.medium,
                            tuple(e.block_hashes),
                            e.block_size,
                            e.parent_block_hash,
                            tuple(e.token_ids),
                        )
                    )
                elif kind == "BlockRemoved":
                    out.append((kind, e.medium, tuple(e.block_hashes)))
                else:
                    out.append((kind,))
        return out


@pytest.fixture
def setup() -> Iterator[tuple[EventBus, ListPublisher, KVEventsSubscriber, CollectorRegistry]]:
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    pub = ListPublisher()
    sub = KVEventsSubscriber(pub, chunk_size=CS, registry=reg)
    bus.register_subscriber(sub)
    bus.start()
    yield bus, pub, sub, reg
    bus.stop()
    assert pub.closed


def send(bus: EventBus, etype: EventType, ts: float = 1.0, **md: object) -> None:
    bus.publish(event(etype, dict(md), timestamp=ts))


def f(*keys: int) -> tuple[int, ...]:
    return tuple(fold64(k) for k in keys)


def test_chunk_keys_fold_to_u64_one_batch_per_bus_event(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, sub, reg = setup
    send(bus, EventType.L1_WRITE_FINISHED, 5.0, keys=[K1, K2], num_bytes=2, parent_keys=[None, K1])
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K1], num_bytes=1, duration_s=0.0)
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K1], num_bytes=0, duration_s=0.0)  # dup
    send(bus, EventType.L1_KEYS_EVICTED, keys=[K1, K3], num_bytes=1)  # K3 was never announced
    send(bus, EventType.L1_READ_FINISHED, keys=[K2], num_bytes=1)  # not a holdings change
    assert bus.flush(5)
    assert [b.ts for b in pub.batches] == [5.0, 1.0, 1.0]
    assert pub.events() == [
        ("BlockStored", "CPU", f(K1, K2), CS, None, ()),
        ("BlockStored", "STORAGE", f(K1), CS, None, ()),
        ("BlockRemoved", "CPU", f(K1)),
    ]
    assert all(0 <= h < 2**64 for h in f(K1, K2, K3))
    assert sub.held_keys("CPU") == {K2} and sub.held_keys("STORAGE") == {K1}
    assert reg.get_sample_value("kvcache_kv_events_events_total", {"type": "BlockStored"}) == 2


def test_l2_backends_share_the_storage_medium(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, sub, _ = setup
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K1, K2], num_bytes=1, duration_s=0.0)
    send(bus, EventType.L2_STORE_FINISHED, backend="redis", keys=[K1], num_bytes=1, duration_s=0.0)
    send(bus, EventType.L2_KEYS_EVICTED, backend="disk", keys=[K1, K2], num_bytes=1)
    send(bus, EventType.L2_LOAD_FAILED, backend="redis", keys=[K1], reason="timeout")  # still held
    send(bus, EventType.L2_LOAD_FAILED, backend="redis", keys=[K1], reason="corrupt")  # deleted
    assert bus.flush(5)
    assert pub.events() == [  # no write told where K1 and K2 sit in their prompts: two roots
        ("BlockStored", "STORAGE", f(K1), CS, None, ()),
        ("BlockStored", "STORAGE", f(K2), CS, None, ()),
        ("BlockRemoved", "STORAGE", f(K2)),
        ("BlockRemoved", "STORAGE", f(K1)),
    ]
    assert sub.held_keys("STORAGE") == set()


def test_clearing_a_tier_reannounces_what_other_tiers_hold(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, sub, _ = setup
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K1, K2], num_bytes=2, parent_keys=[None, K1])
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K2, K3], num_bytes=1, duration_s=0.0)
    send(bus, EventType.L1_CLEARED, num_keys=2)
    send(bus, EventType.L2_CLEARED, backend="disk", num_keys=2)
    assert bus.flush(5)
    assert pub.events()[3:] == [
        ("AllBlocksCleared",),
        ("BlockStored", "STORAGE", f(K2), CS, fold64(K1), ()),
        ("BlockStored", "STORAGE", f(K3), CS, None, ()),
        ("AllBlocksCleared",),
    ]
    assert sub.held_keys("CPU") == sub.held_keys("STORAGE") == set()


def test_chunk_keyed_writes_hang_under_their_parent_and_split_where_they_do_not_continue(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, _, _ = setup
    K0 = (9 << 100) + 9
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K0], num_bytes=1, parent_keys=[None])
    # K1 continues K0 (held); K3 continues K2, which this write skipped: two runs, two parents.
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K1, K3], num_bytes=2, parent_keys=[K0, K2])
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K3], num_bytes=1, duration_s=0.0)
    assert bus.flush(5)
    assert pub.events() == [
        ("BlockStored", "CPU", f(K0), CS, None, ()),
        ("BlockStored", "CPU", f(K1), CS, fold64(K0), ()),
        ("BlockStored", "CPU", f(K3), CS, fold64(K2), ()),
        ("BlockStored", "STORAGE", f(K3), CS, fold64(K2), ()),  # the parent sticks in every tier
    ]


def test_a_chunk_keyed_continuation_of_engine_blocks_hangs_under_the_last_block(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, _, _ = setup
    send(
        bus,
        EventType.L1_WRITE_FINISHED,
        keys=[K1],
        num_bytes=1,
        block_hashes=[10, 11],
        block_size=16,
        parent_block_hashes=[None],
        parent_keys=[None],
    )
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K2], num_bytes=1, parent_keys=[K1])
    assert bus.flush(5)
    assert pub.events()[1] == ("BlockStored", "CPU", f(K2), CS, 11, ())


def test_engine_block_hashes_become_the_identity_in_every_tier(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, _, _ = setup
    # A store of chunks 0 and 2 of a prompt (chunk 1 was already held): two blocks per chunk.
    tokens = list(range(64))
    send(
        bus,
        EventType.L1_WRITE_FINISHED,
        keys=[K1, K3],
        num_bytes=2,
        block_hashes=[10, 11, 30, 31],
        block_size=16,
        parent_block_hashes=[None, 21],
        token_ids=tokens,
    )
    send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K1], num_bytes=1, duration_s=0.0)
    send(bus, EventType.L1_KEYS_EVICTED, keys=[K1], num_bytes=1)
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K1], num_bytes=1)  # reloaded from L2: no hashes sent
    send(bus, EventType.L2_KEYS_EVICTED, backend="disk", keys=[K1], num_bytes=1)
    send(bus, EventType.L1_KEYS_EVICTED, keys=[K1], num_bytes=1)  # gone everywhere: identity forgotten
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K1], num_bytes=1)
    assert bus.flush(5)
    assert pub.events() == [
        ("BlockStored", "CPU", (10, 11), 16, None, tuple(range(32))),
        ("BlockStored", "CPU", (30, 31), 16, 21, tuple(range(32, 64))),
        ("BlockStored", "STORAGE", (10, 11), 16, None, tuple(range(32))),  # tokens kept while held
        ("BlockRemoved", "CPU", (10, 11)),
        ("BlockStored", "CPU", (10, 11), 16, None, tuple(range(32))),
        ("BlockRemoved", "STORAGE", (10, 11)),
        ("BlockRemoved", "CPU", (10, 11)),
        ("BlockStored", "CPU", f(K1), CS, None, ()),
    ]


def test_contiguous_engine_chunks_form_one_run_without_explicit_parents(setup) -> None:  # type: ignore[no-untyped-def]
    bus, pub, _, _ = setup
    send(
        bus, EventType.L1_WRITE_FINISHED, keys=[K1, K2], num_bytes=2, block_hashes=[1, 2, 3, 4], block_size=16
    )
    assert bus.flush(5)
    assert pub.events() == [("BlockStored", "CPU", (1, 2, 3, 4), 16, None, ())]


def test_array_format_and_metrics_track_the_publisher() -> None:
    reg = CollectorRegistry()
    pub = ListPublisher()
    sub = KVEventsSubscriber(pub, chunk_size=CS, fmt="array", registry=reg)
    bus = EventBus(registry=reg)
    bus.register_subscriber(sub)
    with bus:
        send(bus, EventType.L1_WRITE_FINISHED, keys=[K1], num_bytes=1)
        assert bus.flush(5)
    assert type(pub.batches[0].events[0]).__name__ == "ArrayBlockStored"
    for name in ("published_batches_total", "dropped_batches_total", "queue_depth"):
        assert reg.get_sample_value(f"kvcache_kv_events_{name}") == 0.0
    with pytest.raises(ValueError):
        KVEventsSubscriber(pub, chunk_size=0)


def test_a_restarted_disk_tier_announces_what_it_found(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real disk tier restarted on an old directory: its contents reach routers as
    BlockStored(STORAGE) before any request, and a later store of a found key adds nothing."""
    import torch

    from kvcache.storage.l2.disk import DiskL2Adapter

    first = DiskL2Adapter(str(tmp_path), 1 << 20)
    for key in (K1, K2):
        first.store(key, torch.zeros(1, 1, 16, 8))
    reg = CollectorRegistry()
    bus = EventBus(registry=reg)
    pub = ListPublisher()
    sub = KVEventsSubscriber(pub, chunk_size=CS, registry=reg)
    bus.register_subscriber(sub)
    bus.start()
    try:
        DiskL2Adapter(str(tmp_path), 1 << 20, bus=bus)
        send(bus, EventType.L2_STORE_FINISHED, backend="disk", keys=[K1], num_bytes=0, duration_s=0.0)
        assert bus.flush(5)
        events = pub.events()
        assert {(kind, medium) for kind, medium, *_ in events} == {("BlockStored", "STORAGE")}
        assert {h for e in events for h in e[2]} == set(f(K1, K2))
        assert sub.held_keys("STORAGE") == {K1, K2}
    finally:
        bus.stop()


def test_a_chunk_found_in_a_shared_l2_is_announced_in_storage_once_and_withdrawn_when_evicted(setup) -> None:  # type: ignore[no-untyped-def]
    """A daemon that loads a chunk another daemon wrote to a shared tier announces it in
    STORAGE itself (it can load it), once, and withdraws it when it sees it evicted."""
    bus, pub, sub, _ = setup
    load = {"backend": "redis-cluster", "num_bytes": 1, "duration_s": 0.0}
    send(bus, EventType.L2_LOAD_FINISHED, keys=[K1], **load)
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K1], num_bytes=1)  # the prefetch lands in L1
    send(bus, EventType.L2_LOAD_FINISHED, keys=[K1], **load)  # found again: nothing new
    send(bus, EventType.L2_STORE_FINISHED, keys=[K1], **load)  # and written too: nothing new
    send(bus, EventType.L2_KEYS_EVICTED, backend="redis-cluster", keys=[K1, K3], num_bytes=0)
    send(bus, EventType.L2_LOAD_FINISHED, keys=[K1], **load)  # rewritten by someone, found again
    assert bus.flush(5)
    assert pub.events() == [
        ("BlockStored", "STORAGE", f(K1), CS, None, ()),
        ("BlockStored", "CPU", f(K1), CS, None, ()),
        ("BlockRemoved", "STORAGE", f(K1)),
        ("BlockStored", "STORAGE", f(K1), CS, None, ()),
    ]
    assert sub.held_keys("STORAGE") == sub.held_keys("CPU") == {K1}


def test_a_chunk_found_with_its_writer_s_identity_is_announced_as_the_writer_did(setup) -> None:  # type: ignore[no-untyped-def]
    """A shared Redis tier keeps each chunk's ChunkIdentity: a daemon that loads it announces
    it under the writer's engine hashes, parent and tokens, in STORAGE and then in CPU."""
    bus, pub, sub, _ = setup
    ident = ChunkIdentity(
        token_ids=list(range(CS)), block_hashes=[11, 12], block_size=CS // 2, parent_block_hash=10
    )
    load = {"backend": "redis", "num_bytes": 1, "duration_s": 0.0}
    send(bus, EventType.L2_LOAD_FINISHED, keys=[K2], identities=[ident], **load)
    send(bus, EventType.L1_WRITE_FINISHED, keys=[K2], num_bytes=1)  # a prefetch carries no identity
    assert bus.flush(5)
    assert pub.events() == [
        ("BlockStored", "STORAGE", (11, 12), CS // 2, 10, tuple(range(CS))),
        ("BlockStored", "CPU", (11, 12), CS // 2, 10, tuple(range(CS))),
    ]
    assert sub.held_keys("STORAGE") == sub.held_keys("CPU") == {K2}
