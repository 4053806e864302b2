"""The record of one timed workload run, shared by the driver and the report.

Its own module because both sides need it: ``workload.py`` fills it while requests run and
``workload_report.py`` derives every reported number from it. Kept in the driver, it made the
two files import each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """What one run (KV events off or on) measured: client-side timings and daemon counters."""

    kv_events: bool
    seconds: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    lookup_s: list[float] = field(default_factory=list)
    store_bytes: int = 0
    store_s: float = 0.0
    retrieve_bytes: int = 0
    retrieve_s: float = 0.0
    windows: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    kv_event_batches: int = 0
    kv_event_bytes: int = 0  # payload bytes of every batch received
    kv_event_stored: int = 0  # BlockStored events in them
    kv_event_stored_blocks: int = 0  # block hashes in those BlockStored events
    daemon_cpu_s: float | None = None  # CPU the daemon spent serving the timed requests
    repeat: int = 0  # which interleaved off/on pair this run belongs to


__all__ = ["RunResult"]
