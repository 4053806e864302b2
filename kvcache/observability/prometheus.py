"""The Prometheus scrape endpoint: ``/metrics`` over HTTP on exactly the configured address.

Separate from the subscribers because serving is the entry point's decision (a daemon
serves; a library user may scrape the registry another way). Started only by
``init_observability`` or explicitly; nothing listens at import.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from kvcache.netaddr import is_loopback

logger = logging.getLogger(__name__)


class PrometheusEndpoint:
    """A running ``/metrics`` server; ``stop()`` closes the socket and is idempotent.

    Any host is allowed (scraping from another machine is the normal setup); a host that is
    not loopback (``0.0.0.0``, ``::``, an interface address) is logged as a warning at start.
    """

    POLL_S = 0.05
    """How often the serving loop looks for a stop request. ``prometheus_client``'s own
    ``start_http_server`` polls every 0.5 s, which made every daemon stop half a second slower
    (each test that starts a daemon paid it); twenty idle wake-ups a second cost microseconds."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        server = _make_server(host, port, registry)
        self._server: WSGIServer | None = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(self.POLL_S,), name="kvcache-metrics", daemon=True
        )
        self._thread.start()
        self.host = host
        self.port: int = server.server_address[1]  # the real port when 0 was asked for
        if not is_loopback(host):
            logger.warning(
                "metrics on %s are reachable from the network (counters and histograms "
                "only: no keys, no tokens); firewall it to the scrapers", self.url,
            )  # fmt: skip

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(5.0)

    def __enter__(self) -> PrometheusEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _make_server(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """A threading WSGI server for ``/metrics`` on ``host:port``, IPv4 or IPv6 as ``host`` says."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    return make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)


def start_prometheus_endpoint(host: str, port: int, registry: CollectorRegistry) -> PrometheusEndpoint:
    """Serve ``registry`` on ``host:port`` (port 0 picks a free one; see ``.port``)."""
    return PrometheusEndpoint(host, port, registry)


__all__ = ["PrometheusEndpoint", "start_prometheus_endpoint"]
