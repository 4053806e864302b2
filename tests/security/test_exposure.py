"""What each listening socket exposes: KV events and metrics beyond loopback are explicit."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.kv_events.config import (
    add_kv_events_args,
    build_kv_events_subscriber,
    check_exposure,
    validate_kv_events_args,
)
from kvcache.netaddr import endpoint_is_local, is_loopback
from kvcache.observability import init_observability
from kvcache.observability.config import ObservabilityConfig
from kvcache.observability.prometheus import start_prometheus_endpoint
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess, DaemonStartError


def _ns(*argv: str) -> argparse.Namespace:
    return add_kv_events_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "::", "10.0.0.5", "example.com", ""])
def test_everything_else_is_exposed(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [("tcp://*:5557", None), ("tcp://[::]:5557", None), ("ipc:///tmp/x.sock", "tcp://*:5558"),
     ("ipc:///tmp/x.sock", "tcp://0.0.0.0:5558")],
)  # fmt: skip
def test_kv_events_beyond_loopback_need_the_flag(endpoint: str, replay: str | None) -> None:
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        check_exposure(endpoint, replay, allow_remote=False)
    args = ["--kv-events-endpoint", endpoint] + (["--kv-events-replay-endpoint", replay] if replay else [])
    with pytest.raises(ValueError, match="reveals which prompts are cached"):
        build_kv_events_subscriber(_ns(*args))


def test_local_binds_and_connects_need_no_flag(caplog: pytest.LogCaptureFixture) -> None:
    for endpoint, replay in [("ipc:///tmp/kv.sock", None), ("tcp://127.0.0.1:*", "tcp://127.0.0.1:0"),
                             ("tcp://router.example:5557", None)]:  # fmt: skip
        check_exposure(endpoint, replay, allow_remote=False)  # a plain host connects: not a bind
    assert endpoint_is_local("inproc://x") and not endpoint_is_local("tcp://10.1.2.3:1")
    with caplog.at_level(logging.WARNING, logger="kvcache.kv_events"):
        check_exposure("tcp://*:5557", None, allow_remote=True)
    assert "reachable from the network" in caplog.text


def test_allowed_wildcard_bind_really_binds_and_warns(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    ns = _ns("--kv-events-endpoint", "tcp://*:0", "--kv-events-allow-remote")
    with pytest.raises(ValueError, match="without CURVE"):  # any TCP bind authenticates readers
        build_kv_events_subscriber(ns)
    assert keygen(["daemon", "--dir", str(tmp_path)]) == 0
    (tmp_path / "clients.toml").write_text("")
    ns.curve_secret_key, ns.clients = str(tmp_path / "daemon.key_secret"), str(tmp_path / "clients.toml")
    with caplog.at_level(logging.WARNING, logger="kvcache.kv_events"):
        sub = build_kv_events_subscriber(ns)
    assert sub is not None
    sub.shutdown()
    assert "reachable from the network" in caplog.text


def test_metrics_beyond_loopback_are_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        obs = init_observability(ObservabilityConfig(prometheus_host="0.0.0.0", prometheus_port=0))
    obs.shutdown()
    assert "reachable from the network" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        obs = init_observability(ObservabilityConfig(prometheus_host="127.0.0.1", prometheus_port=0))
    obs.shutdown()
    assert "reachable from the network" not in caplog.text


def test_the_warning_says_what_an_allowed_bind_exposes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache.kv_events"):
        check_exposure("ipc:///tmp/kv.sock", "tcp://10.0.0.5:5558", allow_remote=True)
    assert "tcp://10.0.0.5:5558" in caplog.text and "which prompts are cached" in caplog.text


@pytest.mark.parametrize("endpoint", ["ws://*:5557", "wss://0.0.0.0:5557", "epgm://eth0;239.1.1.1:5557"])
def test_other_transports_fail_closed(endpoint: str) -> None:
    """A transport this gate does not know is exposed unless its host is loopback."""
    assert not endpoint_is_local(endpoint)
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        check_exposure("ipc:///tmp/kv.sock", endpoint, allow_remote=False)
    assert endpoint_is_local("ws://127.0.0.1:5557") and endpoint_is_local("tcp://[::1]:5557")


def test_validation_needs_no_socket() -> None:
    """The daemon can refuse the flags while parsing them, before anything is bound."""
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        validate_kv_events_args(_ns("--kv-events-endpoint", "tcp://*:5557"))
    allowed = _ns("--kv-events-endpoint", "tcp://*:5557", "--kv-events-allow-remote")
    with pytest.raises(ValueError, match="without CURVE"):
        validate_kv_events_args(allowed)
    allowed.curve_secret_key, allowed.clients = "daemon.key_secret", "clients.toml"  # read later
    validate_kv_events_args(allowed)
    validate_kv_events_args(_ns("--kv-events-endpoint", "tcp://router:5557"))
    validate_kv_events_args(_ns())


def test_metrics_endpoint_warns_whoever_starts_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache.observability"):
        endpoint = start_prometheus_endpoint("0.0.0.0", 0, CollectorRegistry())
    endpoint.stop()
    assert f"http://0.0.0.0:{endpoint.port}/metrics" in caplog.text
    assert "reachable from the network" in caplog.text


def test_the_daemon_refuses_a_wildcard_kv_events_bind(start_daemon: Callable[..., DaemonProcess]) -> None:
    with pytest.raises(DaemonStartError, match="--kv-events-allow-remote"):
        start_daemon("--kv-events-endpoint", "tcp://*:0")
