"""Translation between wire error codes and kvcache exceptions, both directions, in one place.

The daemon turns whatever a handler raises into an ``Error(code, message)`` reply; the client
turns that reply back into the same exception class, so a caller of ``KVCacheClient`` catches
``BlockIdError`` exactly as it would around an in-process ``CacheEngine``.

Neither direction is a hand-kept table: a kvcache exception carries its code as the class
attribute ``wire_code`` (``kvcache.errors``), and the client's lookup is derived from the
classes that name a code of their own. Errors from outside kvcache (Python's, a library's) are
given a code at one edge, ``_foreign_code``.
"""

from __future__ import annotations

from typing import TypeVar

import kvcache.errors
from kvcache.errors import (
    DaemonUnavailableError,
    ErrorCode,
    KvcacheError,
    RemoteError,
    ShuttingDownError,
)
from kvcache.protocol.messages import Error, Reply

R = TypeVar("R", bound=Reply)

GENERIC_CODES = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.INTERNAL})
"""Codes that unrelated errors share (any ``ValueError`` is a ``BAD_REQUEST``), so they name no
class: a client raises ``RemoteError`` carrying the code."""


def _code_to_class() -> dict[ErrorCode, type[KvcacheError]]:
    """The client's lookup: each specific code to the one class that names it in its body."""
    table: dict[ErrorCode, type[KvcacheError]] = {}
    for cls in vars(kvcache.errors).values():
        if not (isinstance(cls, type) and issubclass(cls, KvcacheError)):
            continue
        own = (cls.wire_code,) if "wire_code" in cls.__dict__ else ()
        for code in own + cls.__dict__.get("wire_aliases", ()):
            if code in GENERIC_CODES:
                continue
            if code in table:
                raise TypeError(f"{code} is named by both {table[code].__name__} and {cls.__name__}")
            table[code] = cls
    return table


_CODE_TO_CLASS = _code_to_class()


def _foreign_code(exc: BaseException) -> ErrorCode:
    """The one edge for errors that are not kvcache's: bad arguments are the caller's fault,
    anything else is the daemon's."""
    if isinstance(exc, (ValueError, IndexError, TypeError)):
        return ErrorCode.BAD_REQUEST
    return ErrorCode.INTERNAL


def error_from_exception(exc: BaseException) -> Error:
    """The reply for an exception a handler raised; unknown kinds become ``INTERNAL``. The
    message is for people and says nothing of the daemon's process: a native library's
    backtrace (torch appends one, with addresses in the daemon's mappings) is cut off."""
    code = type(exc).wire_code if isinstance(exc, KvcacheError) else _foreign_code(exc)
    text = _for_people(str(exc))
    if code is ErrorCode.INTERNAL:
        return Error(code=code, message=f"{type(exc).__name__}: {text}")
    return Error(code=code, message=text or type(exc).__name__)


_BACKTRACE_MARKS = ("Exception raised from ", "\nframe #")
_MAX_MESSAGE = 2000


def _for_people(text: str) -> str:
    """``text`` before any native backtrace, at most ``_MAX_MESSAGE`` characters."""
    for mark in _BACKTRACE_MARKS:
        text = text.split(mark, 1)[0]
    return text.strip()[:_MAX_MESSAGE]


def exception_from_error(err: Error) -> Exception:
    """The exception a client raises for an ``Error`` reply."""
    cls = _CODE_TO_CLASS.get(err.code)
    if cls is None:
        return RemoteError(err.code, err.message)
    return cls(err.message)


def unwrap(reply: Reply, expected: type[R]) -> R:
    """``reply`` if it is an ``expected``; an ``Error`` reply raised as its exception."""
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, Error):
        raise exception_from_error(reply)
    raise DaemonUnavailableError(f"unexpected reply {type(reply).__name__}")


__all__ = [
    "DaemonUnavailableError",
    "RemoteError",
    "ShuttingDownError",
    "error_from_exception",
    "exception_from_error",
    "unwrap",
]
