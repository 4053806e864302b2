"""Handing memfds from an engine to the daemon: ``SCM_RIGHTS`` over a private Unix socket.

Why descriptors and not paths: a path lets a client make the daemon open (or delete) a file
of its choosing, and a file the engine can still shrink lets it kill the daemon with SIGBUS.
A memfd sealed against shrinking (``memfd.empty_shared``) handed over as a descriptor has
neither problem, needs no /dev/shm entry to clean up, and works between containers that
share no /proc.

Protocol, one exchange per connection on an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket: the client
sends one message whose payload is a random ticket (16 to 64 bytes) and whose ancillary data
carries the descriptors (at most ``MAX_FDS_PER_MESSAGE``, the kernel's ``SCM_MAX_FD``); the
daemon answers one ``FdReply``. The client then names the ticket in its ``Register`` request;
``FdInbox.take`` hands the checked descriptors to the handler.

This module is the engine's end (``send_fds``); the daemon's end is
``kvcache.server.fdinbox`` (daemon state: a thread and per-uid quotas) and the wire format both
share is ``fdproto``.
"""

from __future__ import annotations

import socket

import msgspec

from kvcache import trusted_dir
from kvcache.errors import LimitExceededError, ProtocolError, UntrustedPathError
from kvcache.transport.fdproto import (
    ERRORS,
    MAX_FDS_PER_MESSAGE,
    MAX_TICKET,
    MIN_TICKET,
    REPLY_DECODER,
)


def send_fds(
    socket_path: str, ticket: bytes, fds: list[int], timeout_s: float, *, peer_uid: int | None = None
) -> None:
    """Hand ``fds`` to the daemon under ``ticket``; raises the daemon's refusal as the
    matching kvcache error (``AccessDeniedError``, ``LimitExceededError``, ``LayoutError``),
    ``ConnectionError`` when the socket cannot be reached or closes without an answer.
    ``peer_uid``: the uid the listening process must run as (``SO_PEERCRED``), checked after
    connecting and before a byte is sent (``UntrustedPathError`` otherwise)."""
    if not MIN_TICKET <= len(ticket) <= MAX_TICKET:
        raise ValueError(f"a ticket is {MIN_TICKET}..{MAX_TICKET} bytes, got {len(ticket)}")
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise LimitExceededError(
            f"{len(fds)} memfds to hand over; the kernel passes at most {MAX_FDS_PER_MESSAGE} in "
            "one message: allocate the KV cache in fewer empty_shared buffers"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise ConnectionError(
                f"cannot reach the daemon's fd socket {socket_path}: {exc.strerror}; CPU engines "
                "must run on the daemon's host, as its user (or a uid in its --clients)"
            ) from None
        if peer_uid is not None and (uid := trusted_dir.peer_uid(sock)) != peer_uid:
            raise UntrustedPathError(
                f"not handing memfds to {socket_path}: the process listening there runs as uid "
                f"{uid}, not as the expected daemon uid {peer_uid}; another user may have "
                "planted it"
            )
        try:
            socket.send_fds(sock, [ticket], fds)
            data = sock.recv(4096)
        except OSError as exc:
            raise ConnectionError(f"handing memfds to {socket_path} failed: {exc}") from None
    if not data:
        raise ConnectionError(f"the daemon closed {socket_path} without answering")
    try:
        reply = REPLY_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{socket_path} answered something that is no FdReply: {exc}") from None
    if reply.code:
        raise ERRORS[reply.code](reply.message)


__all__ = ["send_fds"]
