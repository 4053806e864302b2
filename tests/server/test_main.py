"""The daemon's command line: defaults, TOML file, flag precedence, refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.config import GiB
from kvcache.server.__main__ import redact_url
from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.daemon import DaemonConfig
from kvcache.server.flags import build_parser
from kvcache.server.settings import parse_settings

from .helpers import free_port


def test_defaults_need_no_external_service() -> None:
    s = parse_settings([])
    assert (s.daemon.host, s.daemon.port, s.daemon.allow_remote) == ("127.0.0.1", 5555, False)
    assert s.daemon.listen_tcp is False and s.daemon.listen_ipc is True  # the Unix socket only
    assert parse_settings(["--tcp"]).daemon.listen_tcp is True
    assert s.engine.l2_disk_path is None and s.engine.l2_redis_url is None
    assert s.engine.chunk_size == 256 and s.engine.l1_size_bytes == 2 * GiB
    assert s.daemon.inline_lookups is True
    assert s.observability.enabled and s.observability.prometheus_port == 9259


def test_storage_flags_reach_the_engine_config() -> None:
    s = parse_settings(
        ["--chunk-size", "128", "--l1-size-gb", "0.5", "--l1-evict-watermark", "0.7",
         "--l2-disk-path", "/tmp/x", "--l2-disk-size-gb", "3", "--l2-redis-url", "redis://h:1/0",
         "--l2-redis-trust-all"]
    )  # fmt: skip
    e = s.engine
    assert (e.chunk_size, e.l1_size_bytes, e.l1_evict_watermark) == (128, GiB // 2, 0.7)
    assert (e.l2_disk_path, e.l2_disk_size_bytes, e.l2_redis_url) == ("/tmp/x", 3 * GiB, "redis://h:1/0")
    assert s.daemon.inline_lookups is False  # a lookup may wait on the network or for L1 room
    assert parse_settings(["--l2-disk-path", "/tmp/x"]).daemon.inline_lookups is False
    assert parse_settings(["--lookup-wait-timeout", "0.5"]).engine.lookup_wait_timeout_s == 0.5


def test_the_per_principal_bounds_and_the_fair_share_are_flags() -> None:
    d = parse_settings(["--max-awaiting-retrieves", "7", "--max-requests-in-flight", "9",
                        "--max-connections-per-client", "5", "--fair-in-flight", "3"])  # fmt: skip
    assert (d.limits.max_awaiting_retrieves, d.daemon.max_in_flight_requests) == (7, 9)
    assert (d.daemon.connections.max_connections_per_client, d.daemon.fair_in_flight) == (5, 3)
    assert parse_settings([]).daemon.fair_in_flight == 16
    with pytest.raises(ValueError, match="fair_in_flight"):
        DaemonConfig(fair_in_flight=0)


def test_redis_timeouts_back_off_and_store_wait_are_flags() -> None:
    e = parse_settings(["--l2-redis-timeout", "0.25", "--l2-redis-connect-timeout", "2",
                        "--l2-redis-ttl", "600", "--l2-retry-interval", "1.5",
                        "--store-wait-timeout", "0"]).engine  # fmt: skip
    assert (e.l2_redis_socket_timeout_s, e.l2_redis_connect_timeout_s, e.l2_redis_ttl_s) == (0.25, 2, 600)
    assert (e.l2_retry_interval_s, e.store_wait_timeout_s) == (1.5, 0)
    d = parse_settings([]).engine
    assert (d.l2_redis_socket_timeout_s, d.l2_retry_interval_s, d.store_wait_timeout_s) == (1.0, 5.0, 5.0)


def test_admission_and_eviction_policies_are_flags() -> None:
    e = parse_settings(["--l2-disk-admission", "second-hit", "--l2-redis-admission", "tinylfu",
                        "--l2-admission-window", "512", "--l1-eviction", "s3fifo",
                        "--l2-disk-eviction", "s3fifo"]).engine  # fmt: skip
    assert (e.l2_disk_admission, e.l2_redis_admission, e.l2_admission_window) == (
        "second-hit",
        "tinylfu",
        512,
    )
    assert (e.l1_eviction, e.l2_disk_eviction) == ("s3fifo", "s3fifo")
    d = parse_settings([]).engine
    assert (d.l2_disk_admission, d.l2_redis_admission, d.l1_eviction, d.l2_disk_eviction) == (
        "always",
    ) * 2 + ("lru",) * 2
    with pytest.raises(SystemExit):  # argparse names the choices
        parse_settings(["--l2-disk-admission", "often"])
    with pytest.raises(SystemExit):
        parse_settings(["--l2-admission-window", "0"])


def test_security_and_limit_flags_reach_the_daemon() -> None:
    s = parse_settings(["--runtime-dir", "/run/kvc", "--no-ipc", "--tcp", "--max-ids", "99", "--max-tensors",
                        "7", "--max-instances", "3", "--max-registration-gb", "2"])  # fmt: skip
    assert (s.daemon.runtime_dir, s.daemon.listen_ipc, s.daemon.listen_tcp) == ("/run/kvc", False, True)
    assert (s.limits.max_ids, s.limits.max_tensors, s.limits.max_instances) == (99, 7, 3)
    assert s.limits.max_registration_bytes == 2 * GiB
    assert parse_settings([]).daemon.runtime_dir  # the default clients look in
    budgets = parse_settings(["--max-in-flight-mb", "128", "--max-awaited-tokens", "5"])
    assert (budgets.daemon.max_in_flight_bytes, budgets.limits.max_awaited_tokens) == (128 << 20, 5)


def test_the_in_flight_budget_holds_at_least_one_largest_request() -> None:
    with pytest.raises(SystemExit):  # a usage error, naming both
        parse_settings(["--max-message-mb", "64", "--max-in-flight-mb", "32"])


def test_toml_file_then_flags_override_it(tmp_path: Path) -> None:
    cfg = tmp_path / "kvcache.toml"
    cfg.write_text(
        '[server]\ntcp = true\nport = 6001\nheartbeat-timeout = 12.5\n'
        '[storage]\nchunk_size = 64\nl2_disk_path = "/var/cache/kv"\n'
        '[observability]\ndisable_lifecycle_metrics = true\nprometheus_port = 9999\n'
        'kv_events_topic = "t"\n'
    )  # fmt: skip
    s = parse_settings(["--config", str(cfg), "--chunk-size", "32"])
    assert s.daemon.port == 6001 and s.daemon.heartbeat_timeout_s == 12.5
    assert s.engine.chunk_size == 32  # the flag wins
    assert s.engine.l2_disk_path == "/var/cache/kv"
    assert not s.observability.lifecycle_metrics and s.observability.prometheus_port == 9999
    assert s.args.kv_events_topic == "t"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[storage]\nl1_size = 3\n", "unknown key 'l1_size' in [storage]"),
        ("[stroage]\nchunk_size = 3\n", "unknown table [stroage]"),
        ("[server]\nchunk_size = 3\n", "unknown key 'chunk_size' in [server]"),
        ("[server\n", "cannot read config file"),
    ],
)
def test_bad_toml_is_refused_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_settings(["--config", str(cfg)])


def test_connection_flags_reach_the_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse_settings(["--max-connections", "40", "--max-connections-per-client", "10",
                        "--handshake-timeout", "2", "--peer-heartbeat", "0"])  # fmt: skip
    assert s.daemon.connections == ConnectionLimits(40, 10, 2.0, 0.0)
    assert parse_settings([]).daemon.connections == ConnectionLimits()
    with pytest.raises(SystemExit):  # one client may not be allowed more than everyone
        parse_settings(["--max-connections", "40", "--max-connections-per-client", "41"])
    assert "max_connections_per_client" in capsys.readouterr().err


def test_invalid_values_exit_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(["--l1-evict-watermark", "1.5"])
    assert info.value.code == 2
    assert "l1_evict_watermark" in capsys.readouterr().err


def test_non_loopback_needs_allow_remote_and_curve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--tcp", "--host", "0.0.0.0"])
    assert "--allow-remote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--tcp", "--host", "0.0.0.0", "--allow-remote"])
    assert "CURVE" in capsys.readouterr().err
    s = parse_settings(["--tcp", "--host", "0.0.0.0", "--allow-remote", "--curve-secret-key",
                        "d.key_secret", "--clients", "c.toml"])  # fmt: skip
    assert s.daemon.host == "0.0.0.0" and s.daemon.curve_secret_key == "d.key_secret"
    # TCP flags without --tcp are refused, not silently dropped (an upgraded config file)
    for argv in (["--host", "0.0.0.0"], ["--port", "6000"], ["--no-tcp", "--allow-remote"]):
        with pytest.raises(SystemExit):
            parse_settings(argv)
        assert "add --tcp" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert DaemonConfig(host=host).host == host


def test_help_explains_the_daemon_to_a_newcomer() -> None:
    parser, dests = build_parser()
    text = parser.format_help()
    for needle in ("daemon.sock", "--tcp", "KVCacheClient", "--l2-disk-path", "--config FILE",
                   "SIGTERM", "--prometheus-port", "--kv-events-endpoint", "--subscriber"):  # fmt: skip
        assert needle in text
    assert {"server", "storage", "observability"} == set(dests)
    assert "l2_redis_url" in dests["storage"] and "prometheus_port" in dests["observability"]


def test_redis_password_never_reaches_the_log() -> None:
    assert redact_url("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_port_in_use_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "kvcache.server", "--tcp", "--port", str(port), "--prometheus-port", "0",
             "--runtime-dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1
    assert f"cannot listen on tcp://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
