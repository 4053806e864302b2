"""Offload statistics: what moved between the engine and the cache, how fast, and how often
a lookup hit. Handed out as deltas.

Separate from the engine because the arithmetic is where vLLM's first offload metrics went
wrong (seed 002): the average time per token is ``sum(seconds) / sum(tokens)`` over the period,
never a mean of per-operation rates, every division is guarded, and a poller receives what
happened *since its previous poll* (snapshot-and-reset), so feeding the deltas to Prometheus
counters never double counts. Deltas from several workers combine with ``aggregate``.

Directions follow the glossary: **store** = engine -> cache, **retrieve** = cache -> engine
(vLLM's offload metrics call the latter "load"; their names keep it). The engine
records bytes, seconds and tokens from its copies' ``TransferResult`` records only (summed per
operation in ``records.CopyTally``, the same figures its MP_*_END events carry), so these
statistics and the metrics built from those events cannot disagree.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

KiB = 1 << 10
#: Upper bounds (bytes) of the per-operation size histogram; a last bucket catches the rest.
SIZE_BUCKETS_BYTES: tuple[int, ...] = tuple(4**k * KiB for k in range(1, 13))  # 4 KiB .. 16 GiB


def _zeros() -> list[int]:
    return [0] * (len(SIZE_BUCKETS_BYTES) + 1)


@dataclass(slots=True)
class TransferStats:
    """One direction's totals. ``size_hist[i]`` counts ops of at most ``SIZE_BUCKETS_BYTES[i]``
    bytes (and above the previous bound); the last entry counts larger ops."""

    bytes: int = 0
    seconds: float = 0.0
    ops: int = 0
    tokens: int = 0
    size_hist: list[int] = field(default_factory=_zeros)

    def record(self, nbytes: int, seconds: float, tokens: int) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.ops += 1
        self.tokens += tokens
        self.size_hist[bisect.bisect_left(SIZE_BUCKETS_BYTES, nbytes)] += 1

    @property
    def seconds_per_token(self) -> float:
        """Weighted average: total seconds over total tokens (0.0 when nothing moved)."""
        return self.seconds / self.tokens if self.tokens else 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: TransferStats) -> None:
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.ops += other.ops
        self.tokens += other.tokens
        self.size_hist = [a + b for a, b in zip(self.size_hist, other.size_hist, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "ops": self.ops,
            "tokens": self.tokens,
            "size_hist": list(self.size_hist),
            "seconds_per_token": self.seconds_per_token,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferStats:
        hist = list(d.get("size_hist") or _zeros())
        if len(hist) != len(SIZE_BUCKETS_BYTES) + 1:
            raise ValueError(f"size_hist has {len(hist)} buckets, expected {len(SIZE_BUCKETS_BYTES) + 1}")
        return cls(int(d["bytes"]), float(d["seconds"]), int(d["ops"]), int(d["tokens"]), hist)


@dataclass(slots=True)
class OffloadStats:
    """Offload activity over one period (a delta, unless built by ``aggregate`` from several)."""

    store: TransferStats = field(default_factory=TransferStats)
    retrieve: TransferStats = field(default_factory=TransferStats)
    lookups: int = 0
    lookup_query_tokens: int = 0
    lookup_hit_tokens: int = 0

    @property
    def avg_store_seconds_per_token(self) -> float:
        return self.store.seconds_per_token

    @property
    def avg_retrieve_seconds_per_token(self) -> float:
        return self.retrieve.seconds_per_token

    @property
    def lookup_hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 when nothing was asked)."""
        return self.lookup_hit_tokens / self.lookup_query_tokens if self.lookup_query_tokens else 0.0

    def is_empty(self) -> bool:
        return not (self.store.ops or self.retrieve.ops or self.lookups)

    @staticmethod
    def aggregate(parts: Iterable[OffloadStats]) -> OffloadStats:
        """Sum of deltas (e.g. one per worker); averages stay weighted by tokens."""
        total = OffloadStats()
        for p in parts:
            total.store.merge(p.store)
            total.retrieve.merge(p.retrieve)
            total.lookups += p.lookups
            total.lookup_query_tokens += p.lookup_query_tokens
            total.lookup_hit_tokens += p.lookup_hit_tokens
        return total

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (derived averages included for readers; ignored by ``from_dict``)."""
        return {
            "store": self.store.to_dict(),
            "retrieve": self.retrieve.to_dict(),
            "lookups": self.lookups,
            "lookup_query_tokens": self.lookup_query_tokens,
            "lookup_hit_tokens": self.lookup_hit_tokens,
            "lookup_hit_rate": self.lookup_hit_rate,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OffloadStats:
        return cls(
            TransferStats.from_dict(d["store"]),
            TransferStats.from_dict(d["retrieve"]),
            int(d["lookups"]),
            int(d["lookup_query_tokens"]),
            int(d["lookup_hit_tokens"]),
        )


class OffloadStatsCollector:
    """Thread-safe accumulator; ``snapshot`` returns the delta since the previous snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cur = OffloadStats()

    def record_store(self, nbytes: int, seconds: float, tokens: int) -> None:
        """One engine -> cache copy; ops that moved nothing are not operations."""
        if tokens > 0:
            with self._lock:
                self._cur.store.record(nbytes, seconds, tokens)

    def record_retrieve(self, nbytes: int, seconds: float, tokens: int) -> None:
        """One cache -> engine copy; ops that moved nothing are not operations."""
        if tokens > 0:
            with self._lock:
                self._cur.retrieve.record(nbytes, seconds, tokens)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.record_lookups(1, query_tokens, hit_tokens)

    def record_lookups(self, count: int, query_tokens: int, hit_tokens: int) -> None:
        """``count`` lookups asking ``query_tokens`` and finding ``hit_tokens`` in all (a
        scheduler step's batch: one hold of the lock, the sums taken by the caller)."""
        with self._lock:
            cur = self._cur
            cur.lookups += count
            cur.lookup_query_tokens += query_tokens
            cur.lookup_hit_tokens += hit_tokens

    def snapshot(self) -> OffloadStats:
        with self._lock:
            out, self._cur = self._cur, OffloadStats()
        return out


__all__ = ["SIZE_BUCKETS_BYTES", "OffloadStats", "OffloadStatsCollector", "TransferStats"]
