"""Requests whose asynchronous load vLLM dropped: their next admission computes, never loads.

Separate from the connector because it is one rule fed by two signals, and because a request
offered a load again here can wait forever in vLLM 0.32 (docs/vllm.md, "A dropped
asynchronous load is not loaded again"): when vLLM drops such a load it frees the request's
blocks but keeps it among its in-flight prefills, so a second asynchronous load reserves the
request's own blocks against it and, when it needs more than half of them, never fits.

The two signals:

* the workers report a request whose own load failed (``failed``, from the worker metadata
  of a model-runner output);
* vLLM asks again about a request admitted with an asynchronous load that has not run since
  (``asked``). It does that only when it dropped the load: the load failed, or a block the
  request shares through vLLM's prefix cache was left unfilled by another request's failed
  load (vLLM truncates every waiting request holding such a block), which no worker sees.

A mark lasts until the request is admitted again, so a later preemption may load.
"""

from __future__ import annotations

from collections.abc import Iterable


class DroppedLoads:
    """The scheduler half's record of requests that must recompute at their next admission."""

    def __init__(self) -> None:
        self._recompute: set[str] = set()  # dropped: the next admission computes
        self._unrun: set[str] = set()  # admitted with an asynchronous load, not scheduled since

    def __contains__(self, req_id: object) -> bool:
        """Marked: offer it no load (``StepLookups`` does not even look it up)."""
        return req_id in self._recompute

    def loading(self, req_id: str) -> None:
        """Admitted with an asynchronous load."""
        self._unrun.add(req_id)

    def ran(self, req_ids: Iterable[str]) -> None:
        """Scheduled in this step: a later question about them follows a preemption."""
        self._unrun.difference_update(req_ids)

    def failed(self, req_ids: Iterable[str]) -> None:
        """The workers report these requests' own asynchronous loads failed."""
        self._recompute.update(req_ids)

    def asked(self, req_id: str) -> bool:
        """vLLM asks about ``req_id`` for an admission; True if it must compute (no load)."""
        self.note_dropped(req_id)
        return req_id in self._recompute

    def note_dropped(self, req_id: str) -> None:
        """The second signal: asked about before it ran, so vLLM dropped its load."""
        if req_id in self._unrun:
            self._unrun.discard(req_id)
            self._recompute.add(req_id)

    def admitted(self, req_id: str) -> None:
        """Admitted (loading or not): the mark has done its work."""
        self._recompute.discard(req_id)

    def forget(self, req_id: str) -> None:
        """Finished or aborted."""
        self._recompute.discard(req_id)
        self._unrun.discard(req_id)


__all__ = ["DroppedLoads"]
