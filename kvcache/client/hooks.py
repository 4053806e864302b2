"""Send hooks: what ``Session.intercept`` wraps around every request the breaker lets through.

Apart from the session and the pipeline because both send through the same hooks (a
synchronous call on the caller's thread, an asynchronous one on a hook thread of its own),
and neither's work depends on what a hook does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.protocol import messages as m

Send = Callable[[m.RequestBody], m.ReplyBody]
SendHook = Callable[[m.RequestBody, Send], m.ReplyBody]
"""``hook(body, send)``: ``send(body)`` delivers it (re-registering and retrying if need be)."""


def hooked(hooks: list[SendHook], send: Send) -> Send:
    """``send`` wrapped in ``hooks``, the last outermost."""
    for hook in hooks:

        def outer(body: m.RequestBody, hook: SendHook = hook, inner: Send = send) -> m.ReplyBody:
            return hook(body, inner)

        send = outer
    return send


__all__ = ["Send", "SendHook", "hooked"]
