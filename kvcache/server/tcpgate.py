"""Shutting a TCP listener at the kernel, for a daemon whose connections are all taken.

Why: libzmq accepts whatever reaches its listener, and the daemon can refuse a surplus
connection only after it was accepted (``connections.ConnectionGuard``), one by one, on a
Python thread; a fast flood outruns that and fills the descriptor table meanwhile. A socket
filter that drops every packet on the listening socket makes the kernel ignore new SYNs (and
the ACKs that would complete them) while it is attached, so the flood stops before libzmq.
Established connections are separate sockets and keep flowing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct

log = logging.getLogger("kvcache.server")

_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27  # Linux <asm-generic/socket.h>
_DROP_EVERY_PACKET = struct.pack("=HBBI", 0x06, 0, 0, 0)  # classic BPF: BPF_RET|BPF_K, 0


class TcpGate:
    """Shuts (``set(True)``) and reopens a listening TCP socket. Peers whose SYN it ignored
    retry (after 1 s, then 3 s, ...) and get in once it is open. Holds a duplicate of the
    listening descriptor; libzmq keeps the original."""

    def __init__(self, listener_fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(listener_fd))
        self._insn = ctypes.create_string_buffer(_DROP_EVERY_PACKET, len(_DROP_EVERY_PACKET))
        self.shut = False

    def set(self, shut: bool) -> None:
        if shut == self.shut:
            return
        try:
            if shut:
                prog = struct.pack("HP", 1, ctypes.addressof(self._insn))  # struct sock_fprog
                self._sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, prog)
            else:
                self._sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        except OSError as exc:
            log.warning("cannot %s the TCP listener: %s", "shut" if shut else "open", exc)
            return
        self.shut = shut
        log.info("TCP listener %s", "shut: the daemon is full" if shut else "open again")

    def close(self) -> None:
        self._sock.close()


def find_listener(endpoint: str) -> int | None:
    """This process's listening TCP descriptor for ``tcp://host:port`` (libzmq's)."""
    port = int(endpoint.rsplit(":", 1)[1])
    for entry in os.listdir("/proc/self/fd"):
        try:
            fd = int(entry)
            if not os.readlink(f"/proc/self/fd/{entry}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        try:
            tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
            listening = tcp and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            if listening and sock.getsockname()[1] == port:
                return fd
        except OSError:
            pass
        finally:
            sock.detach()
    return None


__all__ = ["TcpGate", "find_listener"]
