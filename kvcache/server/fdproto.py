"""The fd socket's wire format, shared by the engine that hands memfds over and the daemon.

Its own module so that both sides (``fdpass.send_fds`` in the engine, ``fdinbox.FdInbox`` in
the daemon) take the limits and the reply from one place without importing each other. The
exchange itself is described in ``fdpass``.
"""

from __future__ import annotations

import array
from typing import Literal

import msgspec

from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError

MIN_TICKET, MAX_TICKET = 16, 64
MAX_FDS_PER_MESSAGE = 253
"""Linux's ``SCM_MAX_FD``: ``sendmsg`` refuses more descriptors in one message (EINVAL)."""
FD_SIZE = array.array("i").itemsize

RefusalCode = Literal["", "access_denied", "limit", "layout"]


class FdReply(msgspec.Struct, frozen=True):
    """The daemon's answer to a hand-over: ``code`` is "" on success, else why it refused."""

    code: RefusalCode = ""
    message: str = ""


ERRORS: dict[RefusalCode, type[Exception]] = {
    "access_denied": AccessDeniedError,
    "limit": LimitExceededError,
    "layout": LayoutError,
}
REPLY_DECODER = msgspec.msgpack.Decoder(FdReply)


def refusal_code(exc: Exception) -> RefusalCode:
    """The reply code for a refusal raised as one of the classes in ``ERRORS`` (the one table
    of codes, read both ways)."""
    for code, cls in ERRORS.items():
        if isinstance(exc, cls):
            return code
    return "layout"


__all__ = [
    "ERRORS",
    "FD_SIZE",
    "MAX_FDS_PER_MESSAGE",
    "MAX_TICKET",
    "MIN_TICKET",
    "REPLY_DECODER",
    "FdReply",
    "RefusalCode",
    "refusal_code",
]
