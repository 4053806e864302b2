"""Which retrieves are synchronous: the scheduler half's answer to vLLM's ``load_kv_async``,
per request, and what it rests on.

Separate from the connector because it is one rule with its own state. An asynchronous
retrieve is reported by the workers at the end of a step (``get_finished``) and vLLM schedules
the request only in the step after that one, so it costs the request one step more than a
synchronous retrieve, which runs before the forward of the step that computes the request.
That step buys something only when there is something else to run in it: other requests'
decode or prefill, which a synchronous retrieve would hold back for its copy. So with
``sync_lone_loads`` (the default) a retrieve is synchronous when nothing else runs (no other
request admitted and unfinished: running, loading or preempted; no asynchronous retrieve in
flight) and when it is a bounded copy from the daemon's L1, by a lookup made in this step,
not a read from L2, which could hold the engine's loop (and every request arriving
meanwhile) for as long as the tier takes. Otherwise it stays asynchronous. A synchronous
retrieve also lets vLLM cache its blocks at once, so requests admitted after it in the same
step that share the prefix find it in vLLM's own prefix cache.

NOTE: the choice is made when vLLM asks for the request's match
(``get_num_new_matched_tokens``), before vLLM admits the requests that come after it in the
same step. A request admitted after a synchronous retrieve in the same step waits for that
copy, as it would with ``async_loads: false``.
"""

from __future__ import annotations


class RetrieveTiming:
    """Which retrieves the scheduler half makes synchronous (module docstring).

    ``async_loads``: the connector's setting (forced on by async scheduling). ``sync_lone``:
    ``sync_lone_loads``, in effect only without async scheduling, whose recovery from a failed
    synchronous retrieve is not exact (``ConnectorConfig``).
    """

    def __init__(self, async_loads: bool, sync_lone: bool) -> None:
        self.async_loads = async_loads
        self.sync_lone = async_loads and sync_lone
        self._live: set[str] = set()  # admitted and not finished: running, loading, preempted
        self._sync: set[str] = set()  # chose a synchronous retrieve at its ask in this step

    def choose(self, req_id: str, l2_tokens: int | None, retrieves_in_flight: bool) -> bool:
        """True if ``req_id``'s retrieve is asynchronous; remembered for its admission
        (``admit``). ``l2_tokens``: how much of the hit the daemon holds only in L2, by a
        lookup made in this step; None when the answer is older (chunks may have gone to L2
        since), which counts as a read from L2. ``retrieves_in_flight``: asynchronous
        retrieves issued and not reported received yet."""
        lone = not (self._live - {req_id} or retrieves_in_flight)
        sync = not self.async_loads or (self.sync_lone and lone and l2_tokens == 0)
        if sync:
            self._sync.add(req_id)
        else:
            self._sync.discard(req_id)
        return not sync

    def admit(self, req_id: str) -> bool:
        """vLLM admitted ``req_id`` in this step (with or without a retrieve, whether the
        connector keys it or not): True if its retrieve, if any, is asynchronous, as
        ``choose`` said at its ask."""
        self._live.add(req_id)
        return self.async_loads and req_id not in self._sync

    def planned(self) -> None:
        """The step is planned: the next step's asks begin (a request asked but not admitted
        is asked again)."""
        self._sync.clear()

    def finished(self, req_id: str) -> None:
        self._live.discard(req_id)
        self._sync.discard(req_id)


__all__ = ["RetrieveTiming"]
