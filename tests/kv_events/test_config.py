"""The KV-events flags: off by default, validated, and building a working subscriber."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.kv_events.config import add_kv_events_args, build_kv_events_subscriber
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher


def parse(*argv: str) -> argparse.Namespace:
    return add_kv_events_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_off_by_default() -> None:
    ns = parse()
    assert ns.kv_events_endpoint is None and ns.kv_events_format == "map"
    assert ns.kv_events_topic == "kv-events" and ns.kv_events_buffer_steps == 10_000
    assert ns.kv_events_batch_window_ms == 10.0 and ns.kv_events_token_ids is True
    assert parse("--no-kv-events-token-ids").kv_events_token_ids is False
    assert build_kv_events_subscriber(ns, CollectorRegistry()) is None


def test_flags_build_a_publishing_subscriber(tmp_path: Path) -> None:
    ns = parse(
        "--kv-events-endpoint",
        f"ipc://{tmp_path}/ev.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{tmp_path}/replay.sock",
        "--kv-events-topic",
        "t",
        "--kv-events-format",
        "array",
        "--kv-events-buffer-steps",
        "5",
        "--kv-events-batch-window-ms",
        "0.5",
        "--no-kv-events-token-ids",
    )
    ns.chunk_size = 64
    reg = CollectorRegistry()
    sub = build_kv_events_subscriber(ns, reg)
    assert sub is not None
    try:
        assert isinstance(sub.publisher, ZmqEventPublisher)
        assert sub.publisher.topic == "t" and sub.publisher.replay_endpoint is not None
        assert sub.chunk_size == 64 and sub.publisher.batch_window_s == 0.0005
        assert sub.token_ids is False
        assert reg.get_sample_value("kvcache_kv_events_dropped_batches_total") == 0.0
    finally:
        sub.shutdown()


BAD = [["--kv-events-format", "json"], ["--kv-events-buffer-steps", "0"],
       ["--kv-events-batch-window-ms", "-1"], ["--kv-events-batch-window-ms", "nan"],
       ["--kv-events-batch-window-ms", "x"]]  # fmt: skip


@pytest.mark.parametrize("argv", BAD)
def test_bad_values_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def test_replay_without_endpoint_and_unopenable_endpoint_are_value_errors() -> None:
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        build_kv_events_subscriber(parse("--kv-events-replay-endpoint", "tcp://127.0.0.1:*"))
    with pytest.raises(ValueError, match="cannot open"):
        build_kv_events_subscriber(parse("--kv-events-endpoint", "nope://*:1"))
