"""Which addresses stay on this host: the one rule every listening socket of kvcache follows.

Kept apart so the request socket, the KV-events sockets and the metrics port all decide
"local or exposed" the same way, without importing each other.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``); False for anything
    else, wildcards (``*``, ``0.0.0.0``, ``::``) and names included."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_is_local(endpoint: str) -> bool:
    """Whether binding the ZMQ ``endpoint`` keeps it on this host: ``ipc://`` and
    ``inproc://`` always, ``tcp://HOST:PORT`` when HOST is loopback."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return is_loopback(host)


__all__ = ["endpoint_is_local", "is_loopback"]
