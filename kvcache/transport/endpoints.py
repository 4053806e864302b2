"""Where a daemon listens: its runtime directory, its ZMQ endpoint and its fd socket.

One home for the paths both ends compute, so the daemon binds exactly where a client with
default settings looks. The client's trust in whatever listens there is checked separately
(``kvcache.protocol.peer_check``).
"""

from __future__ import annotations

import os

from kvcache.protocol.peer_check import FD_SOCKET_NAME, expected_daemon_uid


def default_runtime_dir(uid: int | None = None) -> str:
    """Where the daemon's Unix sockets live: ``$KVCACHE_RUNTIME_DIR`` or /tmp/kvcache-UID, UID
    the daemon's (by default this process's: a client passes the daemon's it expects)."""
    return os.environ.get("KVCACHE_RUNTIME_DIR") or f"/tmp/kvcache-{os.getuid() if uid is None else uid}"


def ipc_endpoint(runtime_dir: str) -> str:
    return f"ipc://{os.path.join(runtime_dir, 'daemon.sock')}"


def fd_socket_path(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, FD_SOCKET_NAME)


def default_endpoint(daemon_uid: int | None = None) -> str:
    """The co-located daemon's Unix socket: in ``$KVCACHE_RUNTIME_DIR``, else in
    /tmp/kvcache-UID, UID the daemon's (``expected_daemon_uid``)."""
    return ipc_endpoint(default_runtime_dir(expected_daemon_uid(daemon_uid)))


__all__ = ["default_endpoint", "default_runtime_dir", "fd_socket_path", "ipc_endpoint"]
