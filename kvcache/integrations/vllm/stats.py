"""What the connector did since vLLM last asked: the payload behind its vLLM metrics.

vLLM collects connector statistics per step: each worker's ``get_kv_connector_stats`` and the
scheduler's are merged (``aggregate``) and handed to the Prometheus logger as a plain dict,
which may cross a process boundary. So the payload here is a flat ``dict[str, int | float |
list[float]]`` with string keys, built and merged without vLLM (unit-testable in the project's
venv); ``metrics.py`` wraps it in vLLM's classes.

Every interval is a delta: ``ConnectorTally.take`` hands over what happened since the previous
take and starts again from zero, so summing the payloads of all workers and all intervals gives
the totals exactly once. Averages are token-weighted (sum of seconds over sum of tokens), never a
mean of per-operation rates, which would let one tiny load weigh as much as a long prompt.
"""

from __future__ import annotations

import threading
from typing import Literal

Payload = dict[str, "int | float | list[float]"]

COUNTERS: tuple[str, ...] = (
    "load_ops", "load_tokens", "load_bytes", "load_seconds", "load_failures",
    "store_ops", "store_tokens", "store_bytes", "store_seconds", "store_failures",
    "stores_poisoned", "lookup_ops", "lookup_tokens", "lookup_hit_tokens_l1",
    "lookup_hit_tokens_l2", "lookup_failures", "requests_not_cached",
    "store_jobs_issued", "store_jobs_settled", "transfer_requests", "transfer_awaited_tokens",
    "transfer_missed_tokens", "transfer_params_invalid",
)  # fmt: skip
"""Summed across workers and intervals."""

SAMPLES: tuple[str, ...] = ("load_sizes", "store_sizes")
"""Per-operation sizes in bytes, concatenated (they become histogram observations)."""


SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""Bytes per load/store operation: the buckets vLLM's offloading connector uses, so the two
histograms can be compared and aggregated."""

# The series ``metrics.KVCachePromMetrics`` registers in vLLM (here, free of vLLM imports, so the
# METRICS.md contract test can read them): (name, kind, documentation, payload key);
# histograms read a list of samples.
PROM_SERIES: list[tuple[str, str, str, str]] = [
    ("vllm:kv_offload_load_bytes", "counter", "Bytes loaded from kvcache into KV blocks.", "load_bytes"),
    ("vllm:kv_offload_load_time", "counter", "Seconds spent loading from kvcache.", "load_seconds"),
    ("vllm:kv_offload_load_size", "histogram", "Bytes per kvcache load operation.", "load_sizes"),
    ("vllm:kv_offload_store_bytes", "counter", "Bytes stored from KV blocks into kvcache.", "store_bytes"),
    ("vllm:kv_offload_store_time", "counter", "Seconds spent storing into kvcache.", "store_seconds"),
    ("vllm:kv_offload_store_size", "histogram", "Bytes per kvcache store operation.", "store_sizes"),
    ("vllm:kvcache_loaded_tokens", "counter", "Tokens loaded from kvcache.", "load_tokens"),
    ("vllm:kvcache_stored_tokens", "counter", "Tokens newly stored into kvcache.", "store_tokens"),
    ("vllm:kvcache_lookup_tokens", "counter", "Prompt tokens looked up in kvcache.", "lookup_tokens"),
    ("vllm:kvcache_load_failures", "counter",
     "kvcache loads that failed (the request recomputes those tokens).", "load_failures"),
    ("vllm:kvcache_store_failures", "counter",
     "kvcache stores that failed (nothing wrong was stored; the prefix stays uncached).", "store_failures"),
    ("vllm:kvcache_stores_poisoned", "counter",
     "Stores cut short because the same step's load of the request failed.", "stores_poisoned"),
    ("vllm:kvcache_lookup_failures", "counter",
     "Lookups that failed (treated as a miss).", "lookup_failures"),
    ("vllm:kvcache_store_jobs_issued", "counter",
     "Stores handed to kvcache; minus store_jobs_settled: stores in flight.", "store_jobs_issued"),
    ("vllm:kvcache_store_jobs_settled", "counter",
     "Stores that finished or failed (their blocks may be freed).", "store_jobs_settled"),
    ("vllm:kvcache_requests_not_cached", "counter",
     "Admissions not served (prompt embeddings; a model not offloaded): never offered or stored.",
     "requests_not_cached"),
    ("vllm:kvcache_transfer_requests", "counter",
     "Decode requests that came with a prefill instance's kvcache transfer parameters.", "transfer_requests"),
    ("vllm:kvcache_transfer_awaited_tokens", "counter",
     "Prompt tokens those parameters named (waited for at the daemon, then loaded).",
     "transfer_awaited_tokens"),
    ("vllm:kvcache_transfer_missed_tokens", "counter",
     "Named tokens that did not arrive by transfer_wait_s (recomputed).", "transfer_missed_tokens"),
    ("vllm:kvcache_transfer_params_invalid", "counter",
     "Decode requests whose kvcache transfer parameters were malformed (served as ordinary ones).",
     "transfer_params_invalid"),
]  # fmt: skip
HIT_SERIES = (
    "vllm:kvcache_lookup_hit_tokens",
    "Prompt tokens kvcache held beyond vLLM's own prefix, by tier.",
)
"""The per-tier hit counter (extra label ``tier``: ``L1`` or ``L2``)."""


class ConnectorTally:
    """Counts one connector half's work; ``take`` returns the delta and resets, ``totals``
    keeps the counters since start (for logs and tests; the size samples only go to ``take``).

    Thread-safe: vLLM may ask for stats from its output thread while a step runs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: Payload = {}
        self._totals: dict[str, int | float] = {}

    def transfer(
        self, op: Literal["load", "store"], tokens: int, nbytes: int, seconds: float, ok: bool = True
    ) -> None:
        """One load or store between vLLM's blocks and the daemon. A failed one counts its time
        and what it did copy: a load that fell short still filled its leading blocks, which
        vLLM keeps (it recomputes from the first unfilled one), and the daemon counts those
        bytes too (``kvcache_offload_load_bytes_total``), so they count here as well."""
        with self._lock:
            self._bump(f"{op}_seconds", seconds)
            if not ok:
                self._bump(f"{op}_failures", 1)
                if not tokens:
                    return
            else:
                self._bump(f"{op}_ops", 1)
            self._bump(f"{op}_tokens", tokens)
            self._bump(f"{op}_bytes", nbytes)
            sizes = self._data.setdefault(f"{op}_sizes", [])
            assert isinstance(sizes, list)
            sizes.append(float(nbytes))

    def lookup(self, tokens: int, hit_tokens: int, l2_tokens: int) -> None:
        with self._lock:
            self._bump("lookup_ops", 1)
            self._bump("lookup_tokens", tokens)
            self._bump("lookup_hit_tokens_l1", hit_tokens - l2_tokens)
            self._bump("lookup_hit_tokens_l2", l2_tokens)

    def count(self, name: str, n: int = 1) -> None:
        """Bump one of ``COUNTERS`` (failures, poisoned stores, requests not cached)."""
        if name not in COUNTERS:
            raise KeyError(f"unknown connector counter {name!r}")
        with self._lock:
            self._bump(name, n)

    def take(self) -> Payload:
        with self._lock:
            data, self._data = self._data, {}
        return data

    def totals(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._totals)

    def _bump(self, key: str, n: int | float) -> None:
        """The caller holds the lock."""
        _add(self._data, key, n)
        self._totals[key] = self._totals.get(key, 0) + n


def merge(into: Payload, other: Payload) -> Payload:
    """Fold ``other`` into ``into`` (counters add, size samples concatenate); returns ``into``."""
    for key, value in other.items():
        if isinstance(value, list):
            mine = into.setdefault(key, [])
            assert isinstance(mine, list)
            mine.extend(value)
        else:
            into[key] = into.get(key, 0) + value  # type: ignore[operator]
    return into


def summarize(data: Payload) -> dict[str, int | float]:
    """One interval in a few numbers, for vLLM's periodic log line."""
    out: dict[str, int | float] = {k: v for k, v in data.items() if not isinstance(v, list)}
    for op in ("load", "store"):
        tokens, seconds, nbytes = (float(_num(data, f"{op}_{k}")) for k in ("tokens", "seconds", "bytes"))
        if tokens:
            out[f"{op}_ms_per_1k_tokens"] = 1e6 * seconds / tokens
        if seconds:
            out[f"{op}_gb_per_s"] = nbytes / seconds / 1e9
    looked = _num(data, "lookup_tokens")
    if looked:
        hit = _num(data, "lookup_hit_tokens_l1") + _num(data, "lookup_hit_tokens_l2")
        out["lookup_hit_rate"] = hit / looked
    return out


def _add(d: Payload, key: str, n: int | float) -> None:
    d[key] = d.get(key, 0) + n  # type: ignore[operator]


def _num(d: Payload, key: str) -> int | float:
    value = d.get(key, 0)
    assert not isinstance(value, list)
    return value


__all__ = [
    "COUNTERS",
    "HIT_SERIES",
    "PROM_SERIES",
    "SAMPLES",
    "SIZE_BUCKETS",
    "ConnectorTally",
    "Payload",
    "merge",
    "summarize",
]
