"""Small combinators over ``concurrent.futures.Future``, shared by the daemon and the client.

Separate because both ends map one future onto another on the thread that completes it (the
daemon turns the engine's result into a reply; the client turns a reply into a result), and
that mapping must never leave the target unresolved: one home for that rule.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


def resolved(value: _R) -> Future[_R]:
    """A future that already holds ``value``."""
    future: Future[_R] = Future()
    future.set_result(value)
    return future


def failed(err: BaseException) -> Future[Any]:
    """A future that already holds ``err``: an entry point that returns futures reports a bad
    call on the future, as it would a failed copy, and never raises at its caller."""
    future: Future[Any] = Future()
    future.set_exception(err)
    return future


def then(
    source: Future[_T],
    ok: Callable[[_T], _R],
    failed: Callable[[BaseException], _R] | None = None,
) -> Future[_R]:
    """A future of ``ok(result)``, or of ``failed(error)`` when ``source`` (or ``ok``) raised;
    without ``failed`` the error is passed on.

    Both run as ``source``'s done-callback, on whichever thread completes it (an engine
    completion thread, the client's I/O thread): they must be quick and must never wait on
    another future.
    """
    target: Future[_R] = Future()

    def settle(done: Future[_T]) -> None:
        try:
            try:
                value = ok(done.result())
            except Exception as err:  # the copy's error, or ok's own
                if failed is None:
                    raise
                value = failed(err)
        except BaseException as err:  # never leave the target open
            target.set_exception(err)
            return
        target.set_result(value)

    source.add_done_callback(settle)
    return target


__all__ = ["failed", "resolved", "then"]
