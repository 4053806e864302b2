"""A TCP proxy in front of a real Redis that can hold back its reads: ``GET`` commands wait
at the proxy until released, while every other command (``EXISTS`` above all) passes.

Why not ``SIGSTOP`` on Redis: a lookup asks ``EXISTS`` and at once starts its L2 -> L1
prefetch with ``GET``; stopping the whole server either stalls the lookup too or comes after
the prefetch already finished (a race the scenario lost at times on a loaded machine). Held
at the proxy, the prefetch's ``GET`` stalls every time and nothing else does.

The proxy parses the client's RESP stream (arrays of bulk strings, pipelines included) and
forwards it command by command, in order: a held ``GET`` holds whatever that connection sent
after it, as a stalled server would. Replies pass untouched. ``fail_reads()`` instead drops
the connection at each ``GET`` (a Redis that resets its connections, or a link that breaks):
the read errors at once rather than stalling.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from kvcache.testing.redis_local import LocalRedis


class RedisReadGate:
    """``with RedisReadGate(redis) as gate``: ``gate.url`` for the daemon, ``hold()`` /
    ``release()`` around the reads to stall."""

    def __init__(self, redis: LocalRedis) -> None:
        host, port = redis.url.removeprefix("redis://").split("/", 1)[0].rsplit(":", 1)
        self._upstream = (host, int(port))
        self._open = threading.Event()
        self._open.set()
        self._failing = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._socks: list[socket.socket] = [self._listener]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="redis-gate").start()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def fail_reads(self, failing: bool = True) -> None:
        """From now on (until called with False), each ``GET`` drops its connection."""
        if failing:
            self._failing.set()
        else:
            self._failing.clear()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> RedisReadGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._upstream)
            except OSError:
                return
            self._socks += [client, server]
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray()
        try:
            while chunk := src.recv(65536):
                buf += chunk
                while (end := _command_end(buf)) is not None:
                    command = bytes(buf[:end])
                    del buf[:end]
                    if _name(command) == b"GET":
                        self._open.wait()
                        if self._failing.is_set():
                            return  # both sockets shut below: the client's read errors
                    dst.sendall(command)
        except OSError:
            pass
        finally:
            _shut(dst)

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _shut(dst)


def _command_end(buf: bytearray) -> int | None:
    """Where the first whole RESP command of ``buf`` ends, or None until it has arrived."""
    line = buf.find(b"\r\n")
    if line < 0:
        return None
    if buf[:1] != b"*":  # an inline command: one line
        return line + 2
    pos = line + 2
    for _ in range(int(buf[1:line])):
        head = buf.find(b"\r\n", pos)
        if head < 0:
            return None
        size = int(buf[pos + 1 : head])
        pos = head + 2 + size + 2
        if pos > len(buf):
            return None
    return pos


def _name(command: bytes) -> bytes:
    """The command's name, upper-case (its first bulk string)."""
    if not command.startswith(b"*"):
        return command.split(b" ", 1)[0].strip().upper()
    head = command.index(b"\r\n", command.index(b"\r\n") + 2)
    start = head + 2
    return command[start : command.index(b"\r\n", start)].upper()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
