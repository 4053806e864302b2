"""Admission to an L2 tier: which chunks are worth writing there at all.

Without it every chunk stored in L1 is written through to every L2 tier, so decode-heavy
traffic (each generated chunk stored once, rarely read again) fills shared storage with bytes
nobody reads, and evicts the ones people do. An admission policy sees every *sighting* of a
chunk (a store, or a hit on L1) and answers, per tier, whether to write it now:

- ``always``: every stored chunk (what kvcache did before admission existed).
- ``second-hit``: a chunk is written on its second sighting among the last ``window`` distinct
  chunks seen (stored, then hit; or stored again after L1 evicted it). One-off chunks never
  reach the tier; a shared system prompt gets there on its first reuse.
- ``tinylfu``: a count-min sketch of recent sighting frequency (4 rows of 4-bit counters,
  halved every ``10 * window`` sightings so old popularity fades). A first sighting is never
  admitted (the doorkeeper); after that a candidate is admitted when the tier has room, and
  over the victim the tier would evict for it only if the sketch counts it more often.

Decisions are cheap (a dict or four array cells) and made under the policy's own lock, since
stores and retrieves call in from different threads. ``on_hit`` answers True at most once
per key and frequency cycle (the sighting that makes the key worth writing), so repeated hits
of a chunk already written do not write it again.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict

from kvcache.config import ADMISSION_NAMES
from kvcache.errors import ConfigError
from kvcache.records import ChunkKey


class AdmissionPolicy(ABC):
    """Decides, per tier, which sighted chunks are written to it. Thread-safe."""

    name: str = ""
    #: Whether decisions weigh the tier's would-be victim (else callers pass None and skip
    #: asking the tier, which takes its lock).
    uses_victim: bool = False

    @abstractmethod
    def on_store(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        """``key`` was stored in L1: record the sighting; True to write it to the tier now.
        ``victim``: what the tier would evict to make room for it (None: room, or unknown)."""

    @abstractmethod
    def on_hit(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        """``key`` was read from L1: record the sighting; True when this sighting makes the
        chunk worth writing (it was not worth it before), so the caller writes it now."""


class AlwaysAdmit(AdmissionPolicy):
    """Every stored chunk is written; hits never write (the chunk was written when stored)."""

    name = "always"

    def on_store(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        return True

    def on_hit(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        return False


class SecondHitAdmission(AdmissionPolicy):
    """Written on the second sighting within the last ``window`` distinct keys sighted.

    The window is a bounded ordered dict (most recent sighting last): a key not sighted again
    before ``window`` others were is forgotten, so memory is O(window) whatever the traffic."""

    name = "second-hit"

    def __init__(self, window: int = 1 << 16) -> None:
        if window <= 0:
            raise ConfigError(f"admission window must be a positive integer, got {window!r}")
        self.window = window
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()
        self._lock = threading.Lock()

    def _sight(self, key: ChunkKey) -> int:
        with self._lock:
            seen = self._seen
            n = seen.get(key, 0) + 1
            seen[key] = n
            seen.move_to_end(key)
            if len(seen) > self.window:
                seen.popitem(last=False)
            return n

    def on_store(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        return self._sight(key) >= 2

    def on_hit(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        return self._sight(key) == 2


class FrequencySketch:
    """Count-min sketch of 4 rows of saturating 4-bit counters (kept one per byte), with
    periodic halving ("aging") after ``sample`` increments. Not thread-safe."""

    _ROWS = 4
    _SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
    _MAX = 15

    def __init__(self, width: int) -> None:
        w = 1
        while w < max(16, width):
            w <<= 1
        self.width = w
        self._mask = w - 1
        self._table = [bytearray(w) for _ in range(self._ROWS)]
        self.sample = 10 * w
        self._additions = 0

    def _cells(self, key: ChunkKey) -> list[int]:
        folded = (key ^ (key >> 64)) & ((1 << 64) - 1)
        return [(((folded * seed) & ((1 << 64) - 1)) >> 40) & self._mask for seed in self._SEEDS]

    def estimate(self, key: ChunkKey) -> int:
        return min(row[i] for row, i in zip(self._table, self._cells(key), strict=True))

    def increment(self, key: ChunkKey) -> int:
        """Count one sighting; returns the new estimate."""
        cells = self._cells(key)
        est = min(row[i] for row, i in zip(self._table, cells, strict=True))
        if est < self._MAX:  # conservative update: only the minimal cells grow
            for row, i in zip(self._table, cells, strict=True):
                if row[i] == est:
                    row[i] = est + 1
            est += 1
        self._additions += 1
        if self._additions >= self.sample:
            self._age()
        return est

    def _age(self) -> None:
        for row in self._table:
            for i, v in enumerate(row):
                if v:
                    row[i] = v >> 1
        self._additions //= 2


class TinyLFUAdmission(AdmissionPolicy):
    """Admit over the would-be victim only if sighted more often (TinyLFU), never on a first
    sighting (doorkeeper); with no victim (room in the tier, or a tier that cannot say), a
    chunk sighted twice is admitted.

    A hit promotes a chunk the first time it wins (it may lose to the victim on its second
    sighting and win on its third); the last ``window`` chunks admitted are remembered so a
    chunk already written is not written again on its next hits."""

    name = "tinylfu"
    uses_victim = True

    def __init__(self, window: int = 1 << 16) -> None:
        if window <= 0:
            raise ConfigError(f"admission window must be a positive integer, got {window!r}")
        self._sketch = FrequencySketch(window)
        self._written: OrderedDict[ChunkKey, None] = OrderedDict()
        self._window = window
        self._lock = threading.Lock()

    def _decide(self, key: ChunkKey, est: int, victim: ChunkKey | None) -> bool:
        if est < 2 or (victim is not None and est <= self._sketch.estimate(victim)):
            return False
        written = self._written
        written[key] = None
        written.move_to_end(key)
        if len(written) > self._window:
            written.popitem(last=False)
        return True

    def on_store(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        with self._lock:
            return self._decide(key, self._sketch.increment(key), victim)

    def on_hit(self, key: ChunkKey, victim: ChunkKey | None) -> bool:
        with self._lock:
            est = self._sketch.increment(key)
            return key not in self._written and self._decide(key, est, victim)

    def estimate(self, key: ChunkKey) -> int:
        with self._lock:
            return self._sketch.estimate(key)


def create_admission(name: str, window: int = 1 << 16) -> AdmissionPolicy:
    """The policy called ``name`` (one of ``kvcache.config.ADMISSION_NAMES``); ``ConfigError`` otherwise."""
    if name == "always":
        return AlwaysAdmit()
    if name == "second-hit":
        return SecondHitAdmission(window)
    if name == "tinylfu":
        return TinyLFUAdmission(window)
    known = ", ".join(ADMISSION_NAMES)
    raise ConfigError(f"unknown L2 admission policy {name!r} (known: {known})")


__all__ = [
    "AdmissionPolicy",
    "AlwaysAdmit",
    "FrequencySketch",
    "SecondHitAdmission",
    "TinyLFUAdmission",
    "create_admission",
]
