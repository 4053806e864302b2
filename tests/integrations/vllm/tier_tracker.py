"""One consumer of both KV-event streams, vLLM's and kvcache's: which block sits in which tier.

A router that places requests by cache hits needs vLLM's GPU tier (``medium="GPU"``, even on
vLLM's CPU backend) and kvcache's CPU and STORAGE tiers in one view, joined on the block hash.
That join only works because the connector hands vLLM's own block hashes to kvcache with each
store; this tracker is the proof, written like ``tests/kv_events/router.py`` from vLLM's wire
format alone (plain pyzmq + msgspec, nothing imported from ``kvcache`` or ``vllm``).

Topology: the tracker *binds* one SUB socket; each publisher gets a plain ``tcp://host:port``
endpoint, which vLLM and kvcache both *connect* to, and its own topic, which names the source.
The tracker may also ``connect`` to publishers that bind. A thread reads the socket (see
``TierTracker``); ``drain`` applies what it has read.

Per source the tracker checks the sequence numbers (from 0, no gaps) and keeps every batch, so
``state_at(ts)`` can say what each tier held at any moment. Both map (vLLM >= 0.24) and array
(vLLM <= 0.23) event forms are accepted, and fields vLLM added later (``group_idx``,
``locality``, ``session_id``, ...) are ignored.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


# -- map form (vLLM >= 0.24): a map with the class name under "type"; unknown keys ignored ---
class _MapEvent(msgspec.Struct, tag=True):
    pass


class BlockStored(_MapEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_MapEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_MapEvent):
    pass


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- array form (vLLM <= 0.23): [tag, fields in declaration order]; extra trailing ignored -----
class _ArrayEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared | _ArrayStored | _ArrayRemoved | _ArrayCleared
_MAP = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY = msgspec.msgpack.Decoder(_ArrayBatch)


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """``(ts, events)`` of one payload in either form (an empty batch decodes as both)."""
    try:
        batch: _MapBatch | _ArrayBatch = _MAP.decode(payload)
    except msgspec.ValidationError:
        batch = _ARRAY.decode(payload)
    return batch.ts, list(batch.events)


def _kind(ev: Event) -> str:
    if isinstance(ev, BlockStored | _ArrayStored):
        return "stored"
    return "removed" if isinstance(ev, BlockRemoved | _ArrayRemoved) else "cleared"


@dataclass(frozen=True)
class Mark:
    """One event's place: event ``index`` of batch ``seq`` of ``source``, sent at ``ts``."""

    source: str
    seq: int
    index: int
    ts: float


@dataclass
class Batch:
    source: str
    seq: int
    ts: float
    events: list[Event]


@dataclass
class _Source:
    batches: list[Batch] = field(default_factory=list)
    next_seq: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)


def _apply(held: dict[str, set[int]], events: Iterable[Event]) -> None:
    """One source's events onto its ``medium -> hashes``; a clear empties all its media."""
    for ev in events:
        kind = _kind(ev)
        if kind == "cleared":
            held.clear()
            continue
        medium = str(ev.medium)  # type: ignore[union-attr]
        hashes = ev.block_hashes  # type: ignore[union-attr]
        if kind == "stored":
            held.setdefault(medium, set()).update(hashes)
        else:
            held.setdefault(medium, set()).difference_update(hashes)


class TierTracker:
    """Binds a SUB socket, follows every topic on it, answers "which tiers hold this block".

    A thread owns the socket and reads it all the time. That is not only to keep up: a SUB
    socket learns of a publisher that connects to it only inside a call on the socket, and
    only then sends its subscription; until it does, the PUB side drops every message.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # nothing is dropped on our side
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = self._sub.bind_to_random_port(f"tcp://{host}")
        #: What each publisher is given: vLLM and kvcache both connect to a plain host:port.
        self.endpoint = f"tcp://{host}:{port}"
        self.sources: dict[str, _Source] = {}
        self._inbox: queue.SimpleQueue[tuple[str, int, bytes]] = queue.SimpleQueue()
        self._connect: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tier-tracker", daemon=True)
        self._thread.start()

    def connect(self, endpoint: str) -> None:
        """Also follow a publisher that binds (e.g. kvcache with ``tcp://*:5557``)."""
        self._connect.put(endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while not self._connect.empty():
                    self._sub.connect(self._connect.get())
                if self._sub.poll(20):
                    topic, seq_b, payload = self._sub.recv_multipart()
                    self._inbox.put((topic.decode(), int.from_bytes(seq_b, "big", signed=True), payload))
        finally:
            self._sub.close(linger=0)
            self._ctx.term()

    # -- receiving -----------------------------------------------------------------------------

    def drain(self, quiet_s: float = 0.3, timeout_s: float = 10.0) -> int:
        """Apply what has arrived, until nothing came for ``quiet_s``; returns batches applied."""
        n = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self._receive(*self._inbox.get(timeout=quiet_s))
            except queue.Empty:
                break
            n += 1
        return n

    def _receive(self, source: str, seq: int, payload: bytes) -> None:
        src = self.sources.setdefault(source, _Source())
        if src.batches and seq != src.next_seq:
            src.gaps.append((src.next_seq, seq))
        src.next_seq = seq + 1
        ts, events = decode_batch(payload)
        src.batches.append(Batch(source, seq, ts, events))

    # -- read-backs ----------------------------------------------------------------------------

    def start_seqs(self) -> dict[str, int]:
        """Per source, the first seq received: above 0 when the stream was joined late (a
        publisher that connects drops what it sends before the subscription reaches it)."""
        return {name: src.batches[0].seq for name, src in self.sources.items() if src.batches}

    def gaps(self) -> dict[str, list[tuple[int, int]]]:
        """Per source, ``(expected, got)`` for every break in the seqs after the first one."""
        return {name: src.gaps for name, src in self.sources.items() if src.gaps}

    def _events(self, source: str) -> Iterator[tuple[Mark, Event]]:
        for b in self.sources.get(source, _Source()).batches:
            for i, ev in enumerate(b.events):
                yield Mark(source, b.seq, i, b.ts), ev

    def find(self, source: str, kind: str, hashes: Iterable[int], medium: str,
             after: Mark | None = None) -> Mark | None:  # fmt: skip
        """The event of ``source`` after ``after`` by which every one of ``hashes`` had been
        named by ``kind`` events ("stored" / "removed") in ``medium``; for "removed", an
        AllBlocksCleared names them all. None if that never happened."""
        want = set(hashes)
        for mark, ev in self._events(source):
            if after is not None and (mark.seq, mark.index) <= (after.seq, after.index):
                continue
            k = _kind(ev)
            if kind == "removed" and k == "cleared":
                return mark
            if k == kind and ev.medium == medium:  # type: ignore[union-attr]
                want.difference_update(ev.block_hashes)  # type: ignore[union-attr]
                if not want:
                    return mark
        return None

    def state_at(self, mark: Mark | None = None) -> dict[tuple[str, str], set[int]]:
        """``(source, medium) -> block hashes`` held just after ``mark`` (the end when None):
        ``mark``'s own stream up to and including that event, the others up to its ``ts``."""
        out: dict[tuple[str, str], set[int]] = {}
        for name in self.sources:
            held: dict[str, set[int]] = {}
            if mark is None:
                evs: Iterable[Event] = (ev for _, ev in self._events(name))
            elif name == mark.source:
                evs = (ev for m, ev in self._events(name) if (m.seq, m.index) <= (mark.seq, mark.index))
            else:
                evs = (ev for m, ev in self._events(name) if m.ts <= mark.ts)
            _apply(held, evs)
            out.update({(name, medium): hashes for medium, hashes in held.items() if hashes})
        return out

    def tiers_of(self, block_hash: int, mark: Mark | None = None) -> set[tuple[str, str]]:
        """Every ``(source, medium)`` that holds ``block_hash`` just after ``mark``."""
        return {tier for tier, hashes in self.state_at(mark).items() if block_hash in hashes}

    def blocks_of(self, source: str, token_ids: Sequence[int], block_size: int) -> list[int]:
        """The hashes ``source`` announced for the full blocks of ``token_ids``, in order, found
        by content (parent hash + the block's tokens) in its BlockStored events; stops at the
        first block it never announced with its tokens."""
        index: dict[tuple[int | None, tuple[int, ...]], int] = {}
        for _, ev in self._events(source):
            if not isinstance(ev, BlockStored | _ArrayStored):
                continue
            bs, toks = ev.block_size, ev.token_ids
            parent: int | None = ev.parent_block_hash
            if len(toks) != bs * len(ev.block_hashes):
                continue  # announced without its tokens: cannot be matched by content
            for i, h in enumerate(ev.block_hashes):
                index.setdefault((parent, tuple(toks[i * bs : (i + 1) * bs])), h)
                parent = h
        out: list[int] = []
        parent_hash: int | None = None
        for i in range(len(token_ids) // block_size):
            found = index.get((parent_hash, tuple(token_ids[i * block_size : (i + 1) * block_size])))
            if found is None:
                break
            out.append(found)
            parent_hash = found
        return out

    def summary(self) -> dict[str, Any]:
        """Per source: batches, events by kind, first/last seq (for failure messages)."""
        out: dict[str, Any] = {}
        for name, src in self.sources.items():
            kinds: dict[str, int] = {}
            for _, ev in self._events(name):
                kinds[_kind(ev)] = kinds.get(_kind(ev), 0) + 1
            seqs = [b.seq for b in src.batches]
            out[name] = {"batches": len(seqs), "events": kinds, "seq": (seqs[0], seqs[-1]) if seqs else None}
        return out


__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "Batch", "Mark", "TierTracker", "decode_batch"]
