"""Which addresses stay on this host: the one rule every listening socket of kvcache follows.

Kept apart so the request socket, the KV-events sockets and the metrics port all decide
"local or exposed" the same way, without importing each other.
"""

from __future__ import annotations

import ipaddress
import socket

# ZMQ transports whose address is HOST:PORT; any other transport but ipc/inproc is exposed.
_HOST_PORT_SCHEMES = ("tcp", "ws", "wss")
_LOCAL_SCHEMES = ("ipc", "inproc")
# Every transport libzmq knows (some only in some builds); anything else it refuses to open.
ZMQ_TRANSPORTS = frozenset(
    {"tcp", "ipc", "inproc", "ws", "wss", "udp", "pgm", "epgm", "norm", "tipc", "vmci"}
)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``, bracketed or not);
    False for anything else, wildcards (``*``, ``0.0.0.0``, ``::``, ``""``) and names included."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> tuple[str, str | None]:
    """``(transport, host)`` of a ZMQ endpoint: ``("tcp", "*")`` for ``tcp://*:5557``,
    ``("tcp", "[::1]")`` for ``tcp://[::1]:5557``; host is None for transports without one
    (``ipc://``, ``inproc://``, or anything unparsable)."""
    scheme, sep, rest = endpoint.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _HOST_PORT_SCHEMES:
        return scheme, None
    rest = rest.split("/", 1)[0]  # ws://host:port/path
    if rest.startswith("["):  # [v6]:port
        end = rest.find("]")
        return scheme, rest[: end + 1] if end > 0 else None
    return scheme, rest.rsplit(":", 1)[0]


def endpoint_is_local(endpoint: str) -> bool:
    """Whether binding the ZMQ ``endpoint`` keeps it on this host: ``ipc://`` and
    ``inproc://`` always, ``tcp://``/``ws://``/``wss://`` when the host is loopback; any
    other transport (pgm, udp, ...) or an address this cannot read counts as exposed."""
    scheme, host = endpoint_host(endpoint)
    if scheme in _LOCAL_SCHEMES:
        return True
    return host is not None and is_loopback(host)


def unix_socket_live(path: str) -> bool:
    """True if something accepts connections on the Unix stream socket ``path`` (ZMQ's
    ipc://): binding there would unlink it from under a live process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


__all__ = ["ZMQ_TRANSPORTS", "endpoint_host", "endpoint_is_local", "is_loopback", "unix_socket_live"]
