"""A TCP proxy whose bulk replies arrive late: a slow L2 link in front of a real redis-server.

Used by the scheduler harness (vLLM venv) and the vLLM end-to-end test (project venv), so it
imports neither vLLM nor anything of the project. What it models is a link with a lag on bulk
data, not a dead server: small replies (``EXISTS``, ``+OK``) pass at once, so the daemon's
lookups still find the chunks an L2 holds, while every reply chunk of at least ``bulk_bytes``
(a chunk's ``GET``) is forwarded ``delay_s`` after it was read. Order is kept per connection
(a small reply behind a late one waits for it), and ``delay_s`` can be changed while it runs
(0: a plain proxy), so one Redis can be filled fast and then served slowly.

The delay is the fault under test, not a wait for an event: nothing in a test sleeps on it.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

_READ = 1 << 16


class SlowLink:
    """``SlowLink(port).start()`` listens on ``self.port`` and forwards to 127.0.0.1:``port``."""

    def __init__(self, upstream_port: int, *, delay_s: float = 0.0, bulk_bytes: int = 4096) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        """Lag of each bulk reply chunk; read on every chunk, so it may change at any time."""
        self.bulk_bytes = bulk_bytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> SlowLink:
        threading.Thread(target=self._accept, name="slow-link-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, lagged: bool) -> None:
        """Copy ``src`` to ``dst``; replies (``lagged``) go through a FIFO that holds each bulk
        chunk until its due time."""
        if not lagged:
            self._copy(src, dst)
            return
        due: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        sender = threading.Thread(target=self._send_due, args=(due, dst), daemon=True)
        sender.start()
        try:
            while data := src.recv(_READ):
                lag = self.delay_s if len(data) >= self.bulk_bytes else 0.0
                due.put((time.monotonic() + lag, data))
        except OSError:
            pass
        due.put(None)

    def _send_due(self, due: queue.Queue[tuple[float, bytes] | None], dst: socket.socket) -> None:
        while (item := due.get()) is not None:
            at, data = item
            wait = at - time.monotonic()
            if wait > 0 and self._closed.wait(wait):
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        self._shut(dst)

    def _copy(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_READ):
                dst.sendall(data)
        except OSError:
            pass
        self._shut(dst)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()


__all__ = ["SlowLink"]
