"""The per-request tier trace as JSON lines: one line per lookup and per retrieve.

A file of its own (not log records) so it can be loaded straight into pandas/duckdb or
``jq`` to answer "where did this request's tokens come from". Size-rotated like a log
(``trace.jsonl`` -> ``trace.jsonl.1`` -> ... ``.N``), so it never fills the disk.

Line fields: ``ts``, ``op`` ("lookup"/"retrieve"), ``request_id`` (the operation's session
id), ``instance_id``, ``model_name``, ``num_tokens``, ``engine_tokens`` (retrieve: tokens the
engine already held; lookup: 0), ``l1_tokens``, ``l2_tokens``, ``missing_tokens``. For a
lookup the tier counts are what it *found* (``l1_hit_tokens``/``l2_hit_tokens``); for a
retrieve what it *served*.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import IO, Any, cast

import msgspec

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, MpLookupEnd, MpRetrieveEnd

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_BACKUPS = 3


class RequestTraceSubscriber(EventSubscriber):
    """Appends one JSON line per MP_LOOKUP_END / MP_RETRIEVE_END to ``path``, rotated by size."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be >= 1 and backups >= 0")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._encode = msgspec.json.Encoder().encode
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed in shutdown
        self._size = self._file.tell()

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_LOOKUP_END: self._on_lookup, EventType.MP_RETRIEVE_END: self._on_retrieve}

    def shutdown(self) -> None:
        self._file.close()

    def _on_lookup(self, event: Event) -> None:
        md = cast(MpLookupEnd, event.metadata)
        self._write(event, md, "lookup", 0, md.l1_hit_tokens, md.l2_hit_tokens, md.num_tokens - md.hit_tokens)

    def _on_retrieve(self, event: Event) -> None:
        md = cast(MpRetrieveEnd, event.metadata)
        self._write(event, md, "retrieve", md.skip_tokens, md.l1_tokens, md.l2_tokens, md.missing_tokens)

    def _write(
        self, event: Event, md: MpLookupEnd | MpRetrieveEnd, op: str, engine: int, l1: int, l2: int, miss: int
    ) -> None:
        record: dict[str, Any] = {
            "ts": event.timestamp,
            "op": op,
            "request_id": event.session_id,
            "instance_id": md.instance_id,
            "model_name": md.model_name,
            "num_tokens": md.num_tokens,
            "engine_tokens": engine,
            "l1_tokens": l1,
            "l2_tokens": l2,
            "missing_tokens": miss,
        }
        line = self._encode(record) + b"\n"
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()
        self._size += len(line)

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0


def add_request_trace_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("request trace")
    g.add_argument(
        "--request-trace-file",
        default=None,
        metavar="PATH",
        help="append one JSON line per lookup/retrieve (tokens per tier) to PATH (default: off)",
    )
    g.add_argument(
        "--request-trace-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="rotate the trace file beyond this size, keeping "
        f"{DEFAULT_BACKUPS} old files (default %(default)s)",
    )
    return parser


def build_request_trace_subscriber(ns: argparse.Namespace) -> RequestTraceSubscriber | None:
    path = getattr(ns, "request_trace_file", None)
    if path is None:
        return None
    return RequestTraceSubscriber(path, getattr(ns, "request_trace_max_bytes", DEFAULT_MAX_BYTES))


__all__ = ["RequestTraceSubscriber", "add_request_trace_args", "build_request_trace_subscriber"]
