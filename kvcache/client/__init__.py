"""What a serving engine imports to use the kvcache daemon: ``KVCacheClient``.

One client serves one engine instance. ``api`` is the data API (store, retrieve, lookup,
reports), a thin layer that builds each wire message; ``session`` delivers them: the two
sockets, the breaker, the heartbeat thread, re-registration after a daemon restart and the
retries. Endpoints, key files and shared tensors come from ``kvcache.transport``; the client
never imports ``kvcache.server``, and the server never imports the client.

``empty_shared`` / ``to_shared`` allocate (or copy) a CPU KV cache in memory the daemon can
map; ``default_endpoint``, ``curve_sockopts`` and ``expected_daemon_uid`` say where the daemon
is, how to speak CURVE to it and which uid it must run as.
"""

from kvcache.client.api import KVCacheClient
from kvcache.protocol.peer_check import expected_daemon_uid
from kvcache.transport.curve import curve_sockopts
from kvcache.transport.endpoints import default_endpoint
from kvcache.transport.memfd import empty_shared, to_shared

__all__ = [
    "KVCacheClient",
    "curve_sockopts",
    "default_endpoint",
    "empty_shared",
    "expected_daemon_uid",
    "to_shared",
]
