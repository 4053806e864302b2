"""The bus subscriber that turns L1/L2 holdings changes into vLLM-format KV-event batches.

Its own module (not part of the publisher) because it is where kvcache's vocabulary (chunk
keys, tiers, backends) is translated into a router's (block hashes, ``medium``); the
publisher only moves bytes.

Rules (one batch per bus event, i.e. per engine operation, which the publisher may merge on
the wire with its neighbours, in order; nothing is sent for an event that changes no holding):

* ``L1_WRITE_FINISHED`` -> ``BlockStored(medium="CPU")``; ``L1_KEYS_EVICTED`` ->
  ``BlockRemoved(medium="CPU")``.
* ``L2_STORE_FINISHED`` (and ``L2_KEYS_FOUND``, a restarted disk tier's contents, and
  ``L2_LOAD_FINISHED``, a chunk found in a tier shared with other daemons, which this one
  can load too) -> ``BlockStored(medium="STORAGE")`` for keys no L2 backend held yet;
  ``L2_KEYS_EVICTED`` (and ``L2_LOAD_FAILED`` with reason ``"corrupt"`` or ``"forged"``,
  after which the tier drops the chunk)
  -> ``BlockRemoved(medium="STORAGE")`` for keys no backend holds any more. Several L2
  backends (disk + Redis) share the one ``STORAGE`` medium.
* ``L1_CLEARED`` / ``L2_CLEARED`` -> ``AllBlocksCleared`` followed, in the same batch, by
  ``BlockStored`` for whatever the other tiers still hold, so a router that drops everything
  on ``AllBlocksCleared`` ends up exact.

Identity of a chunk on the wire: when the store that wrote it carried the engine's own
block hashes (``L1_WRITE_FINISHED`` metadata ``block_hashes``, ``block_size``,
``parent_block_hashes``, optional ``token_ids``; see EVENTS.md), the chunk is
published as those blocks (``block_size`` = engine block size). Otherwise it is one
block whose hash is the chunk key folded to 64 bits (``block_size`` = chunk size), and its
parent is the wire hash of the chunk before it in its prompt (``parent_keys``), so a store
that continues a cached prefix hangs under that prefix instead of starting a new root. The
identity is fixed at the first write and kept in every later event, in every tier, for as
long as some tier holds the chunk. One ``BlockStored`` chains only chunks that continue each
other (each one's parent is the previous one's last hash); a write that skips a chunk it
found already held is announced as several events. Tokens (``token_ids``, unless turned off)
ride with the identity, so every ``BlockStored`` of a chunk carries them. A restarted disk
tier hands back each chunk's identity (``L2_KEYS_FOUND`` ``identities``, from the file
headers), so a restart re-announces the chunks exactly as before.

Runs on the bus dispatcher thread only; its state (which tier holds which key) is plain
dicts with no lock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from prometheus_client.registry import CollectorRegistry

from kvcache.keys import fold64
from kvcache.kv_events.messages import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    AnyEvent,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFactory,
    EventFormat,
)
from kvcache.kv_events.publisher import REPLAY_METRICS, EventPublisher
from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import (
    Event,
    EventType,
    L1KeysEvicted,
    L1WriteFinished,
    L2Cleared,
    L2KeysEvicted,
    L2KeysFound,
    L2LoadFailed,
    L2LoadFinished,
    L2StoreFinished,
)
from kvcache.observability.instruments import MetricSet
from kvcache.records import ChunkIdentity, ChunkKey

_L1 = 1  # bit 0 of a holding mask; L2 backends get bits 1, 2, ... in order of first sight


class _Identity:
    """How one chunk is announced: its block hashes, the hash before them, the block size and
    (when known and wanted) its tokens, kept packed: 8 bytes a token, not a Python int each."""

    __slots__ = ("block_size", "hashes", "parent", "tokens")

    def __init__(
        self, hashes: tuple[int, ...], parent: int | None, block_size: int, tokens: array[int] | None = None
    ) -> None:
        self.hashes = hashes
        self.parent = parent
        self.block_size = block_size
        self.tokens = tokens


class KVEventsSubscriber(EventSubscriber):
    """Publishes BlockStored / BlockRemoved / AllBlocksCleared through ``publisher``."""

    def __init__(
        self,
        publisher: EventPublisher,
        *,
        chunk_size: int,
        fmt: EventFormat = "map",
        registry: CollectorRegistry | None = None,
        token_ids: bool = True,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.publisher = publisher
        self.chunk_size = chunk_size
        self.token_ids = token_ids
        """Send each block's tokens in ``BlockStored.token_ids`` (vLLM does); off: ``[]``."""
        self._make = EventFactory(fmt)
        self._held: dict[ChunkKey, int] = {}
        self._ident: dict[ChunkKey, _Identity] = {}
        self._backend_bits: dict[str, int] = {}
        self._l2_mask = 0
        self.metrics = self._build_metrics()
        if registry is not None:
            self.metrics.register(registry)

    @property
    def name(self) -> str:
        return "KVEventsSubscriber"

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            EventType.L1_WRITE_FINISHED: self._on_l1_write,
            EventType.L1_KEYS_EVICTED: self._on_l1_evicted,
            EventType.L1_CLEARED: self._on_l1_cleared,
            EventType.L2_STORE_FINISHED: self._on_l2_store,
            EventType.L2_KEYS_FOUND: self._on_l2_found,  # a restarted disk tier's contents
            EventType.L2_LOAD_FINISHED: self._on_l2_found,  # found in a shared tier: ours to load too
            EventType.L2_KEYS_EVICTED: self._on_l2_evicted,
            EventType.L2_LOAD_FAILED: self._on_l2_load_failed,
            EventType.L2_CLEARED: self._on_l2_cleared,
        }

    def shutdown(self) -> None:
        self.publisher.shutdown()

    # -- read-backs ----------------------------------------------------------------------------

    def held_keys(self, medium: str) -> set[ChunkKey]:
        """Keys this subscriber has announced as present in ``medium`` ("CPU" / "STORAGE")."""
        mask = _L1 if medium == MEDIUM_CPU else self._l2_mask
        return {k for k, m in self._held.items() if m & mask}

    # -- handlers ------------------------------------------------------------------------------

    def _on_l1_write(self, event: Event) -> None:
        md = cast(L1WriteFinished, event.metadata)
        keys = md.keys
        self._remember(keys, md)
        new = [k for k in keys if not self._held.get(k, 0) & _L1]
        for k in new:
            self._held[k] = self._held.get(k, 0) | _L1
        self._send(event, self._stored(new, MEDIUM_CPU))

    def _on_l1_evicted(self, event: Event) -> None:
        gone = self._drop(cast(L1KeysEvicted, event.metadata).keys, _L1)
        if gone:
            self._send(event, [self._make.removed(self._ids(gone), medium=MEDIUM_CPU)])
        self._forget(gone)

    def _on_l2_store(self, event: Event) -> None:
        md = cast(L2StoreFinished | L2KeysFound | L2LoadFinished, event.metadata)
        bit = self._bit(md.backend)
        new = []
        for k in md.keys:
            mask = self._held.get(k, 0)
            if not mask & self._l2_mask:
                new.append(k)
            self._held[k] = mask | bit
        self._send(event, self._stored(new, MEDIUM_STORAGE))

    def _on_l2_found(self, event: Event) -> None:
        """Chunks a tier holds that this daemon may not have written: a restarted tier's
        contents, or chunks a load found (another daemon may have written them to a shared
        tier). New ones are announced as their ``ChunkIdentity`` when the event carries one
        (how they were announced before the restart, or by their writer), else as known here,
        else by key, as roots. A load of a chunk already announced adds nothing."""
        md = cast(L2KeysFound | L2LoadFinished, event.metadata)
        keys = md.keys
        identities: Sequence[ChunkIdentity | None] = md.identities
        if len(identities) == len(keys):
            found = [(k, i) for k, i in zip(keys, identities, strict=True) if i is not None]
            # Engine-keyed first: a chunk-keyed continuation of one resolves its parent to it.
            for k, ident in sorted(found, key=lambda ki: not ki[1].block_hashes):
                if k not in self._ident:
                    self._ident[k] = self._from_identity(k, ident)
        self._on_l2_store(event)

    def _on_l2_evicted(self, event: Event) -> None:
        md = cast(L2KeysEvicted | L2LoadFailed, event.metadata)
        keys = self._drop(md.keys, self._bit(md.backend))
        gone = [k for k in keys if not self._held.get(k, 0) & self._l2_mask]
        if gone:
            self._send(event, [self._make.removed(self._ids(gone), medium=MEDIUM_STORAGE)])
        self._forget(keys)

    def _on_l2_load_failed(self, event: Event) -> None:
        if cast(L2LoadFailed, event.metadata).reason in ("corrupt", "forged"):  # the tier deleted it
            self._on_l2_evicted(event)

    def _on_l1_cleared(self, event: Event) -> None:
        self._clear_mask(event, _L1)

    def _on_l2_cleared(self, event: Event) -> None:
        self._clear_mask(event, self._bit(cast(L2Cleared, event.metadata).backend))

    # -- helpers -------------------------------------------------------------------------------

    def _clear_mask(self, event: Event, bit: int) -> None:
        cleared = self._drop(list(self._held), bit)
        self._forget(cleared)
        events: list[AnyEvent] = [self._make.cleared()]
        events += self._stored([k for k, m in self._held.items() if m & _L1], MEDIUM_CPU)
        events += self._stored([k for k, m in self._held.items() if m & self._l2_mask], MEDIUM_STORAGE)
        self._send(event, events)

    def _bit(self, backend: str) -> int:
        bit = self._backend_bits.get(backend)
        if bit is None:
            bit = self._backend_bits[backend] = 1 << (len(self._backend_bits) + 1)
            self._l2_mask |= bit
        return bit

    def _drop(self, keys: Iterable[ChunkKey], bit: int) -> list[ChunkKey]:
        """Clear ``bit`` for the keys that had it; returns those keys."""
        out = []
        held = self._held
        for k in keys:
            mask = held.get(k, 0)
            if mask & bit:
                out.append(k)
                if mask == bit:
                    del held[k]
                else:
                    held[k] = mask & ~bit
        return out

    def _forget(self, keys: Iterable[ChunkKey]) -> None:
        """Drop the identity of keys no tier holds any more."""
        for k in keys:
            if k not in self._held:
                self._ident.pop(k, None)

    def _remember(self, keys: Sequence[ChunkKey], md: L1WriteFinished) -> None:
        """Fix the identity of written keys seen for the first time (EVENTS.md,
        ``L1_WRITE_FINISHED``); a key some tier still holds keeps the one it was announced with."""
        if not keys:
            return
        cs = self.chunk_size
        tokens: list[int] | None = md.token_ids if self.token_ids else None
        if tokens is not None and len(tokens) != len(keys) * cs:
            tokens = None
        hashes = md.block_hashes
        parent_keys = md.parent_keys
        parents: list[int | None] = md.parent_block_hashes
        block_size = cs
        if hashes and not len(hashes) % len(keys):
            bpc = len(hashes) // len(keys)
            if len(parents) != len(keys):  # absent: the keys are consecutive
                parents = [None, *(hashes[i * bpc - 1] for i in range(1, len(keys)))]
            block_size = md.block_size or cs // bpc
        elif len(parent_keys) == len(keys):
            bpc = 0
        else:
            return
        for i, k in enumerate(keys):
            if k in self._ident:
                continue
            toks = array("q", tokens[i * cs : (i + 1) * cs]) if tokens is not None else None
            if bpc:
                assert parents is not None
                ident = _Identity(tuple(hashes[i * bpc : (i + 1) * bpc]), parents[i], block_size, toks)
            else:
                assert parent_keys is not None
                ident = _Identity((fold64(k),), self._wire_parent(parent_keys[i]), cs, toks)
            self._ident[k] = ident

    def _from_identity(self, key: ChunkKey, ident: ChunkIdentity) -> _Identity:
        cs = self.chunk_size
        tokens = ident.token_ids if self.token_ids and len(ident.token_ids) == cs else None
        toks = array("q", tokens) if tokens is not None else None
        if ident.block_hashes:
            block_size = ident.block_size or cs // len(ident.block_hashes)
            return _Identity(tuple(ident.block_hashes), ident.parent_block_hash, block_size, toks)
        return _Identity((fold64(key),), self._wire_parent(ident.parent_chunk_key), cs, toks)

    def _wire_parent(self, parent_key: ChunkKey | None) -> int | None:
        """The hash a chunk's parent was announced under (its last block's)."""
        if parent_key is None:
            return None
        known = self._ident.get(parent_key)
        return known.hashes[-1] if known is not None else fold64(parent_key)

    def _identity(self, key: ChunkKey) -> _Identity:
        known = self._ident.get(key)
        return known if known is not None else _Identity((fold64(key),), None, self.chunk_size)

    def _ids(self, keys: Iterable[ChunkKey]) -> list[int]:
        out: list[int] = []
        for k in keys:
            out.extend(self._identity(k).hashes)
        return out

    def _stored(self, keys: Sequence[ChunkKey], medium: str) -> list[AnyEvent]:
        """BlockStored events for ``keys``, one per run of chunks that continue each other
        (each one's parent is the previous one's last hash, with the same block size); a run
        carries tokens only when every chunk of it has them (vLLM: ``block_size`` per hash)."""
        events: list[AnyEvent] = []
        run: list[int] = []
        run_tokens: list[int] | None = None
        parent: int | None = None
        block_size = 0
        for k in keys:
            ident = self._identity(k)
            if run and (
                ident.parent != run[-1]
                or ident.block_size != block_size
                or (ident.tokens is None) != (run_tokens is None)
            ):
                events.append(self._run_stored(run, parent, run_tokens, block_size, medium))
                run = []
            if not run:
                parent, block_size = ident.parent, ident.block_size
                run_tokens = None if ident.tokens is None else []
            run.extend(ident.hashes)
            if run_tokens is not None and ident.tokens is not None:
                run_tokens.extend(ident.tokens)
        if run:
            events.append(self._run_stored(run, parent, run_tokens, block_size, medium))
        return events

    def _run_stored(
        self, hashes: list[int], parent: int | None, tokens: list[int] | None, block_size: int, medium: str
    ) -> AnyEvent:
        return self._make.stored(
            hashes,
            block_size=block_size,
            medium=medium,
            parent_block_hash=parent,
            token_ids=tokens,
        )

    def _send(self, event: Event, events: list[AnyEvent]) -> None:
        if not events:
            return
        counts = self._event_counts
        for ev in events:
            counts[type(ev)].value += 1
        ts = event.timestamp if event.timestamp is not None else 0.0
        self.publisher.publish(EventBatch(ts=ts, events=events))

    def _build_metrics(self) -> MetricSet:
        m = MetricSet()
        published = m.counter(
            "kvcache_kv_events_published_batches_total", "KV-event batches sent on the PUB socket."
        )
        dropped = m.counter(
            "kvcache_kv_events_dropped_batches_total",
            "KV-event batches dropped (publisher queue full or send failed); routers see a seq gap.",
        )
        depth = m.gauge("kvcache_kv_events_queue_depth", "KV-event batches waiting for the publisher thread.")
        replay = {attr: m.counter(name, doc) for attr, name, doc in REPLAY_METRICS}
        kinds = m.add(
            "kvcache_kv_events_events_total", "KV events built, by vLLM event type.", "counter", ("type",)
        )
        types = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        by_name = {t: kinds.counter(t) for t in types}
        # Keyed by the event class (both wire forms), so counting costs one dict lookup.
        self._event_counts = {
            cls: by_name[cls.__name__.removeprefix("Array")]
            for cls in (BlockStored, BlockRemoved, AllBlocksCleared, ArrayBlockStored, ArrayBlockRemoved,
                        ArrayAllBlocksCleared)
        }  # fmt: skip

        def refresh() -> None:
            published.value = self.publisher.published_batches
            dropped.value = self.publisher.dropped_batches
            depth.set(self.publisher.queue_depth)
            for attr, counter in replay.items():
                counter.value = getattr(self.publisher, attr)

        m.on_collect(refresh)
        return m


__all__ = ["KVEventsSubscriber"]
