"""The JSONL request trace: one line per lookup/retrieve, per-tier fields, size rotation, flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.observability.bus import EventBus
from kvcache.observability.event import Event, EventType
from kvcache.observability.subscribers.logging.request_trace import (
    RequestTraceSubscriber,
    add_request_trace_args,
    build_request_trace_subscriber,
)
from tests.helpers import event

META = {"instance_id": 3, "model_name": "llama", "device": "cpu", "num_tokens": 512}


def retrieve(i: int) -> Event:
    md = {**META, "skip_tokens": 128, "l1_tokens": 256, "l2_tokens": 0, "missing_tokens": 128}
    return event(EventType.MP_RETRIEVE_END, md, session_id=f"req-{i}", timestamp=float(i))


def test_lines_carry_tiers_for_lookups_and_retrieves(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    bus = EventBus(registry=CollectorRegistry())
    bus.register_subscriber(RequestTraceSubscriber(str(path)))
    with bus:
        bus.publish(
            event(
                EventType.MP_LOOKUP_END,
                {**META, "hit_tokens": 384, "l1_hit_tokens": 256, "l2_hit_tokens": 128},
                session_id="req-0",
                timestamp=1.0,
            )
        )
        bus.publish(retrieve(2))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {
            "ts": 1.0,
            "op": "lookup",
            "request_id": "req-0",
            "instance_id": 3,
            "model_name": "llama",
            "num_tokens": 512,
            "engine_tokens": 0,
            "l1_tokens": 256,
            "l2_tokens": 128,
            "missing_tokens": 128,
        },
        {
            "ts": 2.0,
            "op": "retrieve",
            "request_id": "req-2",
            "instance_id": 3,
            "model_name": "llama",
            "num_tokens": 512,
            "engine_tokens": 128,
            "l1_tokens": 256,
            "l2_tokens": 0,
            "missing_tokens": 128,
        },
    ]


def test_rotation_by_size_keeps_bounded_backups(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sub = RequestTraceSubscriber(str(path), max_bytes=1000, backups=2)
    bus = EventBus(registry=CollectorRegistry())
    bus.register_subscriber(sub)
    with bus:
        for i in range(60):
            bus.publish(retrieve(i))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    newest = [json.loads(x)["request_id"] for x in path.read_text().splitlines()]
    assert newest[-1] == "req-59"
    older = [json.loads(x)["request_id"] for x in (tmp_path / "trace.jsonl.1").read_text().splitlines()]
    assert int(older[-1].split("-")[1]) + 1 == int(newest[0].split("-")[1])  # nothing lost in between


def test_flags(tmp_path: Path) -> None:
    parser = add_request_trace_args(argparse.ArgumentParser())
    assert build_request_trace_subscriber(parser.parse_args([])) is None
    trace = str(tmp_path / "t.jsonl")
    ns = parser.parse_args(["--request-trace-file", trace, "--request-trace-max-bytes", "10"])
    sub = build_request_trace_subscriber(ns)
    assert sub is not None and sub.max_bytes == 10
    sub.shutdown()
    with pytest.raises(ValueError):
        RequestTraceSubscriber(str(tmp_path / "x"), max_bytes=0)
