"""The daemon's flags and TOML file: ``build_parser`` and ``load_toml``.

Apart from ``settings`` (which turns the parsed flags into the daemon's, the engine's and the
observability's configs and checks them together) because this is the daemon's user-facing
vocabulary, one flag per setting with its help text, read by ``--help`` and by the workload
benchmark; what a flag means to the code is decided in ``settings``.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvcache.config import EngineConfig, GiB
from kvcache.kv_events.config import add_kv_events_args
from kvcache.observability.config import add_observability_args
from kvcache.observability.subscribers.logging.request_trace import add_request_trace_args
from kvcache.plugins import add_plugin_args
from kvcache.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES
from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.handlers import Limits
from kvcache.server.policy_flags import add_policy_args
from kvcache.server.share_flags import add_share_args

DESCRIPTION = """\
Run the kvcache daemon: serving engines on this host connect to it over ZMQ, share their
KV cache tensors (GPU: CUDA IPC, CPU: shared memory), and store, look up and retrieve
KV chunks kept in CPU memory (L1) and optionally on local disk or Redis (L2).

With no flags it listens only on its Unix socket ipc://$KVCACHE_RUNTIME_DIR/daemon.sock
(default /tmp/kvcache-UID/daemon.sock, in a directory only this user can enter), keeps a
2 GiB L1 and needs no external service. Engines of this user connect with
kvcache.client.KVCacheClient(), which finds that socket. TCP is off unless --tcp is given
(engines of other users and hosts, with CURVE keys: docs/operator-guide.md, Security)."""

EPILOG = """\
examples:
  python -m kvcache.server
  python -m kvcache.server --l1-size-gb 32 --l2-disk-path /var/cache/kvcache --l2-disk-size-gb 500
  python -m kvcache.server --l2-redis-url redis+cluster://10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000
  python -m kvcache.server --config kvcache.toml --tcp --port 6000

config file (TOML; flags given on the command line override it):
  [server]          tcp, host, port, allow_remote, workers, fast_workers, heartbeat_timeout, ...
  [storage]         chunk_size, l1_size_gb, l1_evict_watermark, l2_disk_path, l2_disk_size_gb,
                    l2_redis_url, l2_redis_timeout, l2_retry_interval, store_wait_timeout, ...
  [observability]   the observability, kv events, request trace and plug-in flags below
  keys are the flag names without '--', with '_' or '-' (l1_size_gb = 32)

SIGTERM or Ctrl-C stops it cleanly: no new requests, in-flight ones finish, pending L2
writes are flushed, events are drained, exit status 0."""

_SECTIONS = ("server", "storage", "observability")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5555


def build_parser(
    prog: str = "python -m kvcache.server",
) -> tuple[argparse.ArgumentParser, dict[str, set[str]]]:
    """The parser, and the flag destinations that each TOML section may set."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with [server], [storage], "
                        "[observability] tables; flags override it")  # fmt: skip
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    dests: dict[str, set[str]] = {}

    before = _dests(parser)
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--tcp",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also listen on TCP (--host, --port); without CURVE keys every local "
        "user reaches it as one anonymous client that must show a registration "
        "token for every instance request (default: off, the ipc:// socket only)",
    )
    srv.add_argument(
        "--host", default=None, help=f"TCP address to listen on, with --tcp (default {DEFAULT_HOST})"
    )
    srv.add_argument(
        "--port", type=int, default=None, help=f"TCP port, with --tcp (default {DEFAULT_PORT}; 0 = any free)"
    )
    srv.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (needs --curve-secret-key and --clients)",
    )
    srv.add_argument(
        "--runtime-dir",
        default=None,
        metavar="DIR",
        help="private directory for the Unix sockets daemon.sock (ipc:// "
        "requests) and fds.sock (CPU memfd hand-over); default $KVCACHE_RUNTIME_DIR "
        "or /tmp/kvcache-UID, where clients look by default. Created 0700 if "
        "missing; an existing one must be a real directory of this user, 0700, or "
        "the daemon refuses to start",
    )
    srv.add_argument(
        "--no-ipc",
        dest="ipc",
        action="store_false",
        help="do not listen on the ipc:// socket (the fd socket stays)",
    )
    srv.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="the daemon's CURVE key pair (a .key_secret file from `kvcache keys`): "
        "TCP clients (and KV-events readers on TCP) must then authenticate and "
        "traffic is encrypted",
    )
    srv.add_argument(
        "--clients",
        default=None,
        metavar="FILE",
        help="allow-list TOML: [[client]] entries with a CURVE public_key, optionally "
        "restricted to models / cache_salts, kv_events = true for routers "
        "(docs/operator-guide.md)",
    )
    lim = Limits()
    srv.add_argument(
        "--max-instances",
        type=int,
        default=lim.max_instances,
        help="engine instances registered at once (default %(default)s)",
    )
    srv.add_argument(
        "--max-instances-per-client",
        type=int,
        default=lim.max_instances_per_client,
        help="instances one client other than the daemon's own user may hold "
        "(default %(default)s; never all of --max-instances)",
    )
    srv.add_argument(
        "--max-tensors",
        type=int,
        default=lim.max_tensors,
        help="KV tensors in one registration (default %(default)s)",
    )
    srv.add_argument(
        "--max-registration-gb",
        type=float,
        default=lim.max_registration_bytes / GiB,
        help="engine memory one registration may map, GiB (default %(default)g)",
    )
    srv.add_argument(
        "--max-ids",
        type=int,
        default=lim.max_ids,
        help="token ids, block ids or block hashes in one request (default %(default)s)",
    )
    srv.add_argument(
        "--workers", type=int, default=4, help="threads for register/store/retrieve (default %(default)s)"
    )
    srv.add_argument(
        "--fast-workers",
        type=int,
        default=2,
        help="threads for lookup/ping/status/reports, never blocked by stores (default %(default)s)",
    )
    srv.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="release an engine's registration after this long without a message "
        "(clients ping every third of it; default %(default)s)",
    )
    srv.add_argument(
        "--max-message-mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_BYTES / 2**20,
        help="largest request frame; a larger one closes its connection (default %(default)g)",
    )
    add_share_args(srv, lim)
    conn = ConnectionLimits()
    srv.add_argument(
        "--handshake-timeout",
        type=float,
        default=conn.handshake_timeout_s,
        metavar="SECONDS",
        help="close a connection that has not finished its ZMQ handshake by then (default %(default)s)",
    )
    srv.add_argument(
        "--peer-heartbeat",
        type=float,
        default=conn.peer_heartbeat_s,
        metavar="SECONDS",
        help="ping each connection this often and close it after "
        "three intervals without an answer (default %(default)s; 0 = off)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on shutdown, wait this long for in-flight requests (default %(default)s)",
    )
    dests["server"] = _dests(parser) - before

    before = _dests(parser)
    st = parser.add_argument_group("storage")
    defaults = EngineConfig()
    st.add_argument(
        "--chunk-size",
        type=int,
        default=defaults.chunk_size,
        help="tokens per chunk, a multiple of the engines' block size (default %(default)s)",
    )
    st.add_argument(
        "--l1-size-gb",
        type=float,
        default=defaults.l1_size_bytes / GiB,
        help="CPU memory for cached chunks, GiB (default %(default)g)",
    )
    st.add_argument(
        "--l1-evict-watermark",
        type=float,
        default=defaults.l1_evict_watermark,
        help="after a store, evict least recently used chunks down to this fraction "
        "of L1 (default %(default)s)",
    )
    st.add_argument(
        "--l2-disk-path",
        default=None,
        metavar="DIR",
        help="directory for the disk tier; chunks survive restarts (default: off). "
        "It, its subdirectories and chunk files must be this user's, closed to others "
        "(0700 / 0600) and no symlinks, or the daemon refuses to start",
    )
    st.add_argument(
        "--l2-disk-size-gb",
        type=float,
        default=defaults.l2_disk_size_bytes / GiB,
        help="bound of the disk tier, GiB (default %(default)g)",
    )
    st.add_argument(
        "--l2-redis-url",
        default=None,
        metavar="URL",
        help="a Redis/Valkey tier shared by hosts: redis://host:port/db for one "
        "server, redis+cluster://host:port,host:port,... for a Redis/Valkey "
        "Cluster (docs/cluster.md); a URL with a password belongs in --config "
        "(every local user reads a command line); default: off",
    )
    st.add_argument(
        "--l2-redis-auth-key-file",
        default=None,
        metavar="FILE",
        help="secret (32+ bytes, this user's, mode 0600) that seals Redis records; only "
        "records sealed with it are served, so give every daemon of a fleet the same file",
    )
    st.add_argument(
        "--l2-redis-trust-all",
        action="store_true",
        help="instead of a key file: serve whatever anyone who can write to the Redis "
        "wrote (only for a Redis no one else can write to; docs/cluster.md)",
    )
    st.add_argument(
        "--l2-redis-timeout",
        type=float,
        default=defaults.l2_redis_socket_timeout_s,
        metavar="SECONDS",
        help="bound on one Redis command (default %(default)s)",
    )
    st.add_argument(
        "--l2-redis-connect-timeout",
        type=float,
        default=defaults.l2_redis_connect_timeout_s,
        metavar="SECONDS",
        help="bound on connecting to Redis (default %(default)s)",
    )
    st.add_argument(
        "--l2-redis-ttl",
        type=int,
        default=None,
        metavar="SECONDS",
        help="expiry of Redis entries (default: none, the server's maxmemory policy)",
    )
    st.add_argument(
        "--l2-retry-interval",
        type=float,
        default=defaults.l2_retry_interval_s,
        metavar="SECONDS",
        help="after a tier times out or is unreachable, treat it as "
        "a miss for this long before trying again (default %(default)s)",
    )
    st.add_argument(
        "--store-wait-timeout",
        type=float,
        default=defaults.store_wait_timeout_s,
        metavar="SECONDS",
        help="how long a store may wait for L1 room held by "
        "write-through to L2, or for a place in a busy L2 queue, before chunks are "
        "dropped and counted (default %(default)s; 0 = never wait)",
    )
    st.add_argument(
        "--lookup-wait-timeout",
        type=float,
        default=defaults.lookup_wait_timeout_s,
        metavar="SECONDS",
        help="how long a lookup may wait for L1 room held by "
        "loads in flight to load its L2 chunks into, before its prefix ends there "
        "(default %(default)s; 0 = never wait)",
    )
    add_policy_args(st, defaults)
    dests["storage"] = _dests(parser) - before

    before = _dests(parser)
    add_observability_args(parser)
    add_kv_events_args(parser)
    add_request_trace_args(parser)
    add_plugin_args(parser)
    dests["observability"] = _dests(parser) - before
    return parser, dests


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest != "help"}


def load_toml(path: str, dests: dict[str, set[str]]) -> dict[str, Any]:
    """Flatten the TOML tables into argparse destinations, refusing unknown keys."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise SystemExit("error: --config needs Python >= 3.11 (or `pip install tomli`)") from None
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"error: cannot read config file {path}: {exc}") from None
    out: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in _SECTIONS or not isinstance(table, dict):
            raise SystemExit(f"error: {path}: unknown table [{section}]; expected one of {list(_SECTIONS)}")
        for key, value in table.items():
            dest = key.replace("-", "_")
            if dest not in dests[section]:
                raise SystemExit(
                    f"error: {path}: unknown key {key!r} in [{section}]; known: {sorted(dests[section])}"
                )
            out[dest] = value
    return out


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "DESCRIPTION", "EPILOG", "build_parser", "load_toml"]
