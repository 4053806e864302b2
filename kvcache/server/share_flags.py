"""The daemon's flags for what one principal may make it hold, and how principals share it.

Their own module because they are one decision an operator makes together (how much of the
daemon any one tenant may take: requests, bytes, awaits, connections, requests in service),
documented in docs/operator-guide.md ("Fair share between principals"), and so ``flags`` does
not grow past what one reader holds.
"""

from __future__ import annotations

import argparse

from kvcache.server.daemon_config import DaemonConfig
from kvcache.server.registration import Limits


def add_share_args(group: argparse._ArgumentGroup, lim: Limits) -> None:
    """The per-principal bounds (``Limits``' await bounds, ``DaemonConfig``'s in-flight and
    connection caps) and ``--fair-in-flight`` (``DaemonConfig.fair_in_flight``)."""
    daemon = DaemonConfig()
    group.add_argument(
        "--max-awaited-tokens",
        type=int,
        default=lim.max_awaited_tokens,
        help="token ids one client's retrieves awaiting a prefill's chunks "
        "(await_chunks) hold at once (default %(default)s)",
    )
    group.add_argument(
        "--max-awaiting-retrieves",
        type=int,
        default=lim.max_awaiting_retrieves,
        help="retrieves awaiting a prefill's chunks (await_chunks) one client may have at "
        "once; each is answered at its own bound (default %(default)s)",
    )
    group.add_argument(
        "--max-in-flight-mb",
        type=float,
        default=daemon.max_in_flight_bytes / 2**20,
        help="request bytes one client may have sent and not had answered; past it "
        "a request is refused (LIMIT) instead of queued (default %(default)g)",
    )
    group.add_argument(
        "--max-requests-in-flight",
        type=int,
        default=daemon.max_in_flight_requests,
        help="requests one client may have sent and not had answered, by number; past it "
        "a request is refused (LIMIT) instead of queued (default %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=daemon.connections.max_connections,
        help="open connections in all; a new one beyond it is closed at once "
        "(default %(default)s; with --max-message-mb it bounds the memory of "
        "requests still arriving)",
    )
    group.add_argument(
        "--max-connections-per-client",
        type=int,
        default=daemon.connections.max_connections_per_client,
        help="open connections of one client: a uid on ipc://, all of loopback TCP, "
        "or one address on CURVE TCP (default %(default)s)",
    )
    group.add_argument(
        "--fair-in-flight",
        type=int,
        default=daemon.fair_in_flight,
        metavar="N",
        help="requests in service at once, shared out between the principals with work: "
        "alone a principal may have N, with k others N/(k+1), at least 1 (default %(default)s)",
    )


__all__ = ["add_share_args"]
