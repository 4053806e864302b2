"""``DaemonConfig``: how the daemon listens and schedules, checked once when it is built.

Apart from ``daemon`` (the loop that uses it) because it is a value with its own rules, read
by the CLI, tests and the loop alike; keeping it here leaves ``daemon`` about threads and
sockets. ``kvcache.server.daemon`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.netaddr import is_loopback
from kvcache.protocol import messages as m
from kvcache.server.connection_limits import ConnectionLimits


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """How the daemon listens and schedules; storage settings live in ``EngineConfig``."""

    host: str = "127.0.0.1"
    port: int = 5555
    """0 picks a free port (``Daemon.endpoint`` tells which)."""
    allow_remote: bool = False
    """Binding a non-loopback address exposes the cache to the network; it must be asked for,
    and it needs CURVE (``curve_secret_key`` and an allow-list with public keys)."""
    listen_tcp: bool = False
    """Off by default: without CURVE, every local user reaches TCP as one anonymous principal
    (``auth.LOOPBACK``); the ipc:// socket knows its peer's uid."""
    runtime_dir: str | None = None
    """Private directory (0700) for the Unix sockets: ``daemon.sock`` (the ``ipc://`` request
    endpoint) and ``fds.sock`` (memfd hand-over). None: a fresh temporary directory, removed
    at exit; the CLI passes ``transport.endpoints.default_runtime_dir()``, where clients look by default."""
    listen_ipc: bool = True
    curve_secret_key: str | None = None
    """A ``*.key_secret`` certificate (``kvcache keys``): the TCP endpoint then speaks CURVE."""
    clients_file: str | None = None
    """Allow-list TOML (``auth.load_clients``): CURVE public keys and extra uids, with tenants."""
    bulk_workers: int = 4
    fast_workers: int = 2
    heartbeat_timeout_s: float = 30.0
    max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES
    max_in_flight_bytes: int = 16 * m.DEFAULT_MAX_MESSAGE_BYTES
    """Request bytes one client may have read by the daemon and not yet answered (``budget``):
    past it a request is refused at once (``LIMIT``) instead of queued. At least
    ``max_message_bytes``, so any one request fits."""
    max_in_flight_requests: int = 16384
    """Requests one client may have read and not yet answered, by number (``budget``)."""
    fair_in_flight: int = 16
    """Requests in service at once (dispatched to a worker, copies not yet done), shared out
    between the principals with work (``fair_queue``): alone, a principal may have them all."""
    drain_timeout_s: float = 30.0
    """On shutdown, how long in-flight requests may take before the daemon stops anyway."""
    inline_lookups: bool = True
    """Serve lookups on the I/O thread; turn off when a lookup may wait (any L2 tier)."""
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """Connection caps, handshake and heartbeat timeouts (``connections``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.bulk_workers < 1 or self.fast_workers < 1:
            raise ValueError("each worker lane needs at least one thread")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.fair_in_flight < 1:
            raise ValueError(f"fair_in_flight must be >= 1, got {self.fair_in_flight}")
        if self.max_in_flight_requests < 1:
            raise ValueError(f"max_in_flight_requests must be >= 1, got {self.max_in_flight_requests}")
        if self.max_in_flight_bytes < self.max_message_bytes:
            raise ValueError(
                f"max_in_flight_bytes ({self.max_in_flight_bytes}) must be >= max_message_bytes "
                f"({self.max_message_bytes}): a request that large could never be served"
            )
        if not self.listen_tcp and not self.listen_ipc:
            raise ValueError("the daemon needs at least one of the TCP and ipc:// endpoints")
        if self.listen_tcp and not is_loopback(self.host):
            if not self.allow_remote:
                raise ValueError(
                    f"refusing to listen on non-loopback address {self.host!r}: anyone who can "
                    "reach it could read and overwrite the cache; pass --allow-remote (with "
                    "CURVE keys) to do it anyway"
                )
            if self.curve_secret_key is None or self.clients_file is None:
                raise ValueError(
                    f"listening on {self.host!r} needs CURVE authentication and encryption: "
                    "pass --curve-secret-key and --clients (keys from `kvcache keys`)"
                )


__all__ = ["DaemonConfig"]
