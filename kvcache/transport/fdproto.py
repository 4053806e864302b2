"""The fd socket's wire format, shared by the engine that hands memfds over and the daemon,
and the record of one hand-over as the daemon received it (``ReceivedFds``).

Its own module so that both sides (``fdpass.send_fds`` in the engine,
``kvcache.server.fdinbox.FdInbox`` in the daemon) take the limits and the reply from one place
without importing each other, and so that ``memfd.import_fd_tensor`` can read a hand-over
without knowing the daemon's inbox. The exchange itself is described in ``fdpass``.
"""

from __future__ import annotations

import array
import contextlib
import os
from dataclasses import dataclass, field
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


@dataclass
class ReceivedFds:
    """Checked descriptors of one hand-over, with their sizes and the sender's credentials.

    Each size was read after its shrink seal was seen, so the memfd can never be smaller.
    The descriptors are the holder's to close (``close``); mappings made from them stay."""

    fds: list[int]
    sizes: list[int]
    uid: int
    pid: int
    expires: float = field(default=0.0, repr=False)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


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
    "ReceivedFds",
    "RefusalCode",
    "refusal_code",
]
