"""What a retrieve awaiting another engine's chunks holds of its principal's two await bounds.

Apart from the handlers because it is one account with two doors: the daemon's I/O thread
takes it as it reads the request (``hold``), an in-process caller of the handlers as it
submits (``takes``), and both give it back when the retrieve is answered. Each held await
costs a wait pass and an answer at its bound whatever its size, hence a count bound
(``--max-awaiting-retrieves``) beside the token bound (``--max-awaited-tokens``).
"""

from __future__ import annotations

from kvcache.errors import PrincipalLimitError
from kvcache.protocol import messages as m
from kvcache.protocol.errors import error_from_exception
from kvcache.server.budget import Takes, awaited_tokens, awaiting_retrieves, take_each
from kvcache.server.refusals import RefusalTally
from kvcache.server.registration import Limits


class AwaitBounds:
    """Per principal: retrieves awaiting chunks, and the token ids they hold; thread-safe."""

    def __init__(self, limits: Limits, refusals: RefusalTally) -> None:
        self._awaits = awaited_tokens(limits.max_awaited_tokens)
        self._awaiting = awaiting_retrieves(limits.max_awaiting_retrieves)
        self._refusals = refusals
        self._early_replies = {  # the I/O thread's refusals: built once per bound
            b.flag: error_from_exception(b.refusal()) for b in (self._awaiting, self._awaits)
        }

    def takes(self, req: m.Retrieve) -> Takes:
        """What an awaiting retrieve holds up to its wait bound (``server.budget``): one of the
        principal's awaiting retrieves, and its token ids (counted from the packed bytes, so
        before any id is unpacked); nothing for a retrieve that does not await."""
        if not req.await_chunks:
            return ()
        return ((self._awaiting, 1), (self._awaits, len(req.token_ids.data) // req.token_ids.width))

    def hold(self, body: m.RequestBody, principal: str) -> Takes | m.Error:
        """What ``body`` holds of ``principal``'s await bounds, taken now (``give_each`` them
        back at its reply), or the ``LIMIT`` reply when they are full, counted as refused.
        The daemon takes them as it reads the request, not at the worker: a flood read faster
        than the workers submit was all below the bound at read and was refused later, one
        build, hop and deferred reply each (2,929 of 5,000 in one measured flood, whose
        replies then held the I/O thread for 0.5 s). Nothing for any other request."""
        if not isinstance(body, m.Retrieve) or not body.await_chunks:
            return ()
        takes = self.takes(body)
        try:
            take_each(principal, takes)
        except PrincipalLimitError as exc:
            self._refusals.add(principal, exc.flag, "retrieve")
            return self._early_replies[exc.flag]
        return takes


__all__ = ["AwaitBounds"]
