"""The daemon's settings from its flags and an optional TOML file: ``parse_settings``.

Separate from ``__main__`` (which wires the engine, the observability and the loop together
and handles signals) so the flags can be parsed, checked and tested without starting
anything. The flags themselves (names, defaults, help, the TOML tables) are in ``flags``;
here they become the daemon's, the engine's and the observability's configs, checked
together. Precedence: built-in defaults < ``--config FILE`` < flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.config import EngineConfig, GiB
from kvcache.kv_events.config import use_runtime_dir, validate_kv_events_args
from kvcache.observability.config import ObservabilityConfig
from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.daemon import DaemonConfig
from kvcache.server.flags import DEFAULT_HOST, DEFAULT_PORT, build_parser, load_toml
from kvcache.server.handlers import Limits
from kvcache.transport.endpoints import default_runtime_dir


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``main`` needs, resolved from defaults, the TOML file and the flags."""

    daemon: DaemonConfig
    limits: Limits
    engine: EngineConfig
    observability: ObservabilityConfig
    log_level: str
    args: argparse.Namespace
    """The parsed flags, for the subscriber builders that read them (KV events, plug-ins)."""


def parse_settings(argv: Sequence[str] | None = None, prog: str = "python -m kvcache.server") -> Settings:
    parser, dests = build_parser(prog)
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_toml(first.config, dests))
    ns = parser.parse_args(argv)
    if not ns.tcp:
        given = [f for f, v in (("--host", ns.host), ("--port", ns.port),
                                ("--allow-remote", ns.allow_remote)) if v not in (None, False)]  # fmt: skip
        if given:  # an upgraded command line or config file must not lose its TCP door silently
            parser.error(f"{', '.join(given)} configure the TCP endpoint, which is off by "
                         "default: add --tcp (tcp = true in [server]), or drop them")  # fmt: skip
    runtime_dir = ns.runtime_dir or default_runtime_dir()
    try:
        daemon = DaemonConfig(
            host=ns.host if ns.host is not None else DEFAULT_HOST,
            port=ns.port if ns.port is not None else DEFAULT_PORT,
            allow_remote=ns.allow_remote,
            bulk_workers=ns.workers,
            fast_workers=ns.fast_workers,
            heartbeat_timeout_s=ns.heartbeat_timeout,
            max_message_bytes=int(ns.max_message_mb * 2**20),
            max_in_flight_bytes=int(ns.max_in_flight_mb * 2**20),
            max_in_flight_requests=ns.max_requests_in_flight,
            fair_in_flight=ns.fair_in_flight,
            drain_timeout_s=ns.drain_timeout,
            # With an L2 tier a lookup may wait (on Redis, or for L1 room held by loads in
            # flight, up to --lookup-wait-timeout): keep it off the I/O thread.
            inline_lookups=ns.l2_redis_url is None and ns.l2_disk_path is None,
            listen_tcp=ns.tcp,
            listen_ipc=ns.ipc,
            runtime_dir=runtime_dir,
            curve_secret_key=ns.curve_secret_key,
            clients_file=ns.clients,
            connections=ConnectionLimits(
                max_connections=ns.max_connections,
                max_connections_per_client=ns.max_connections_per_client,
                handshake_timeout_s=ns.handshake_timeout,
                peer_heartbeat_s=ns.peer_heartbeat,
            ),
        )
        limits = Limits(
            max_instances=ns.max_instances,
            max_instances_per_client=ns.max_instances_per_client,
            max_tensors=ns.max_tensors,
            max_registration_bytes=int(ns.max_registration_gb * GiB),
            max_ids=ns.max_ids,
            max_awaited_tokens=ns.max_awaited_tokens,
            max_awaiting_retrieves=ns.max_awaiting_retrieves,
        )
        engine = EngineConfig(
            chunk_size=ns.chunk_size,
            l1_size_bytes=int(ns.l1_size_gb * GiB),
            l1_evict_watermark=ns.l1_evict_watermark,
            l2_disk_path=ns.l2_disk_path,
            l2_disk_size_bytes=int(ns.l2_disk_size_gb * GiB),
            l2_redis_url=ns.l2_redis_url,
            l2_redis_auth_key_file=ns.l2_redis_auth_key_file,
            l2_redis_socket_timeout_s=ns.l2_redis_timeout,
            l2_redis_connect_timeout_s=ns.l2_redis_connect_timeout,
            l2_redis_ttl_s=ns.l2_redis_ttl,
            l2_retry_interval_s=ns.l2_retry_interval,
            store_wait_timeout_s=ns.store_wait_timeout,
            lookup_wait_timeout_s=ns.lookup_wait_timeout,
            l1_eviction=ns.l1_eviction,
            l2_disk_eviction=ns.l2_disk_eviction,
            l2_disk_admission=ns.l2_disk_admission,
            l2_redis_admission=ns.l2_redis_admission,
            l2_admission_window=ns.l2_admission_window,
        )
        obs = ObservabilityConfig.from_args(ns)
        use_runtime_dir(ns, runtime_dir)
        validate_kv_events_args(ns)  # refuse an exposed KV-events bind before anything binds
    except ValueError as exc:
        parser.error(str(exc))
    _check_redis_trust(parser, ns)  # after the URL's own checks
    if not obs.enabled and (ns.kv_events_endpoint or ns.request_trace_file or ns.subscriber):
        parser.error(
            "--disable-observability turns the event bus off; KV events, the request trace "
            "and --subscriber plug-ins need it"
        )
    return Settings(daemon, limits, engine, obs, ns.log_level, ns)


def _check_redis_trust(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """A Redis tier needs a stated trust: a key file (its records are sealed, nobody else's
    are served) or ``--l2-redis-trust-all``; never both, and neither without a Redis tier.
    The key file is read here so a bad one stops the daemon before it binds anything."""
    key, trust_all = ns.l2_redis_auth_key_file, ns.l2_redis_trust_all
    if ns.l2_redis_url is None:
        if key is not None or trust_all:
            parser.error("--l2-redis-auth-key-file and --l2-redis-trust-all need --l2-redis-url")
        return
    if key is None and not trust_all:
        parser.error(
            "--l2-redis-url needs --l2-redis-auth-key-file FILE (records sealed with a key "
            "every daemon of the fleet shares; make one with: (umask 077; openssl rand -hex 32 "
            "> FILE)), or --l2-redis-trust-all to serve whatever anyone who can write to that "
            "Redis wrote (docs/cluster.md, Who a shared Redis trusts)"
        )
    if key is not None and trust_all:
        parser.error("--l2-redis-auth-key-file and --l2-redis-trust-all exclude each other")
    if key is not None:
        from kvcache.storage.l2.redis.seal import RecordSeal

        try:
            RecordSeal.from_file(key)
        except (ValueError, OSError) as exc:  # UntrustedPathError is an OSError too
            parser.error(str(exc))


__all__ = ["Settings", "parse_settings"]
