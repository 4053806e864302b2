"""``trusted_dir``: the peer fields libzmq reports for an ``ipc://`` connection."""

from __future__ import annotations

from kvcache.trusted_dir import ipc_peer_pid, ipc_peer_uid


def test_an_ipc_peers_uid_and_pid_are_read_from_its_zap_address() -> None:
    assert (ipc_peer_uid("host:1000:1000:4242"), ipc_peer_pid("host:1000:1000:4242")) == (1000, 4242)
    assert ipc_peer_pid("host:0:0:0") == 0  # a peer in a pid namespace this one cannot see
    assert (ipc_peer_uid("127.0.0.1"), ipc_peer_pid("127.0.0.1")) == (None, None)  # TCP: none
    assert ipc_peer_pid("host:1000:1000:x") is None
