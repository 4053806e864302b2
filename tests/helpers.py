"""Shared test helpers (tests are a package: ``from tests.helpers import RecordingSink``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
import pytest

from kvcache.observability.event import EVENT_META, Event, EventMeta, EventType
from kvcache.server.launch import DaemonProcess, Spawn
from kvcache.testing.redis_cluster_local import LocalRedisCluster


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` (every 10 ms) until it holds, failing the test naming ``what`` after
    ``timeout_s``: for a state that has no event to wait on, rather than a sleep that may end
    before the state is reached on a slow machine (and the test then proves nothing)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class RecordingSink:
    """An EventSink that keeps every event, for asserting on what the data path published.

    Thread-safe: L2 completions publish from I/O threads.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def publish(self, event: Event) -> None:
        # The typed contract: each event type carries its own Struct (EVENTS.md).
        assert type(event.metadata) is EVENT_META[event.event_type], event
        with self._lock:
            self.events.append(event)

    def of(self, etype: EventType) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.event_type is etype]


_BLANK: dict[Any, Any] = {int: 0, float: 0.0, str: "", bool: True}
"""What ``meta`` puts in a required field a test leaves out: nothing happened, and an
operation succeeded unless the test says otherwise."""


def meta(event_type: EventType, **fields: Any) -> EventMeta:
    """``event_type``'s metadata Struct with ``fields``; required fields the test does not
    care about are blank (``_BLANK``, empty lists), so a test names only what it checks."""
    cls = EVENT_META[event_type]
    for f in msgspec.structs.fields(cls):
        if f.required and f.name not in fields:
            fields[f.name] = _BLANK.get(f.type, [])
    return cls(**fields)


def event(
    event_type: EventType, fields: Mapping[str, Any], session_id: str = "", timestamp: float | None = None
) -> Event:
    """An ``Event`` whose metadata is ``meta(event_type, **fields)``."""
    return Event(event_type, meta(event_type, **fields), session_id, timestamp)


bench_quick_run = pytest.mark.skipif(
    os.environ.get("KVCACHE_BENCH_QUICK_RUNS") != "1",
    reason="a benchmark's --quick run against real engine servers takes minutes on 2 cores; "
    "what it drives is tested end to end in tests/integrations: KVCACHE_BENCH_QUICK_RUNS=1 runs it",
)
"""Marks a benchmark's ``--quick`` end-to-end run: by hand, not in CI (issue 21: the suite's time)."""


def daemon_starter(
    base_args: list[str], spawn: Spawn | None = None
) -> Iterator[Callable[..., DaemonProcess]]:
    """Body of a ``start_daemon`` fixture: starts ``python -m kvcache.server`` processes with
    ``base_args`` plus the test's own (through ``spawn``: the session's ``daemon_spawn``), and
    kills them (and removes their socket directories) when the test ends."""
    started: list[DaemonProcess] = []

    def start(*args: str, **kw: Any) -> DaemonProcess:
        kw.setdefault("spawn", spawn)
        d = DaemonProcess([*base_args, *args], **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()
        d.remove_runtime_dir()


def counts(result: Any) -> tuple[int, int, int, int]:
    """A store result's chunk and token counts (stored, skipped, failed, stored tokens),
    without its measured bytes and seconds, for exact comparisons."""
    return (result.stored_chunks, result.skipped_chunks, result.failed_chunks, result.stored_tokens)


def start_cluster() -> LocalRedisCluster:
    """A started 3 + 3 Redis Cluster, or a skip naming what is missing (CI installs
    redis-server, which brings redis-cli)."""
    try:
        cluster = LocalRedisCluster(masters=3, replicas=1, node_timeout_ms=1000)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        return cluster.start()
    except BaseException:
        cluster.close()
        raise


def sealed_redis_args(directory: Any) -> list[str]:
    """The daemon flags of a fleet that seals its Redis records: a fresh key file (0600) in
    ``directory``; every daemon given the same list serves the others' records."""
    path = os.path.join(str(directory), f"l2-{os.urandom(4).hex()}.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return ["--l2-redis-auth-key-file", path]
