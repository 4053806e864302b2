"""Connection limits as values: validation and fitting them to the descriptor limit."""

from __future__ import annotations

import pytest

from kvcache.server.connection_limits import ConnectionLimits
from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM


def test_caps_are_fitted_to_what_the_descriptor_limit_leaves() -> None:
    limits = ConnectionLimits()
    assert limits.fitted(1 << 20) is limits  # room to spare: unchanged
    small = limits.fitted(DESCRIPTOR_HEADROOM + 200)  # half of the 200 left: 100
    assert (small.max_connections, small.max_connections_per_client) == (100, 100)
    assert (small.handshake_timeout_s, small.peer_heartbeat_s) == (limits.handshake_timeout_s,
                                                                  limits.peer_heartbeat_s)  # fmt: skip
    assert limits.fitted(10).max_connections == 1  # never zero: the daemon still serves


@pytest.mark.parametrize(
    "kwargs",
    [{"max_connections": 0}, {"max_connections_per_client": 0},
     {"max_connections": 4, "max_connections_per_client": 5}, {"handshake_timeout_s": 0},
     {"peer_heartbeat_s": -1}],
)  # fmt: skip
def test_nonsense_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ConnectionLimits(**kwargs)  # type: ignore[arg-type]
