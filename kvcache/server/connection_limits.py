"""How many connections the daemon holds, per client, and for how long: the operator's numbers.

Separate from ``connections`` (which enforces them on the I/O thread) so that the settings
and the daemon's config can name them without the guard's machinery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import zmq

from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM

log = logging.getLogger("kvcache.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How many connections the request socket holds, and how long an idle one may stay."""

    max_connections: int = 256
    """Open connections on all request endpoints together (handshaking ones included)."""
    max_connections_per_client: int = 128
    """Open connections of one client (``uid:N``, ``loopback``, or a CURVE peer's address)."""
    handshake_timeout_s: float = 10.0
    """A connection that has not finished the ZMTP handshake by then is closed."""
    peer_heartbeat_s: float = 10.0
    """Ping each connection this often; one silent for three intervals is closed (0: off)."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not 1 <= self.max_connections_per_client <= self.max_connections:
            raise ValueError(
                f"max_connections_per_client must be in [1, max_connections={self.max_connections}], "
                f"got {self.max_connections_per_client}"
            )
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if self.peer_heartbeat_s < 0:
            raise ValueError(f"peer_heartbeat_s must be >= 0, got {self.peer_heartbeat_s}")

    def apply(self, router: zmq.Socket[Any], max_message_bytes: int) -> None:
        """Set the timeouts and the frame cap on the ROUTER (before it binds)."""
        router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        router.setsockopt(zmq.HANDSHAKE_IVL, _ms(self.handshake_timeout_s))
        if self.peer_heartbeat_s > 0:
            router.setsockopt(zmq.HEARTBEAT_IVL, _ms(self.peer_heartbeat_s))
            router.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(3 * self.peer_heartbeat_s))
            router.setsockopt(zmq.HEARTBEAT_TTL, _ms(3 * self.peer_heartbeat_s))

    def fitted(self, soft_limit: int) -> ConnectionLimits:
        """These limits, the total clamped to half the descriptors left after the headroom."""
        room = max(1, (soft_limit - DESCRIPTOR_HEADROOM) // 2)
        if self.max_connections <= room:
            return self
        log.warning(
            "the descriptor limit (%d) leaves room for %d connections, not %d: accepting at most "
            "%d (raise `ulimit -n` to allow more)", soft_limit, room, self.max_connections, room,
        )  # fmt: skip
        per_client = min(self.max_connections_per_client, room)
        return ConnectionLimits(room, per_client, self.handshake_timeout_s, self.peer_heartbeat_s)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


__all__ = ["ConnectionLimits"]
