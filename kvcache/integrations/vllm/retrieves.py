"""Asynchronous retrieves in flight on one worker rank: which request waits on which copy.

Separate from ``worker.py`` because it is the one piece of state that decides when vLLM may
touch a retrieving request's blocks: a request is reported received (vLLM then schedules it, or
frees its blocks if it was aborted meanwhile) only once every retrieve issued for it has settled,
and a request vLLM preempted is waited for before the next forward writes into its old
blocks. What a settled retrieve did to the step bookkeeping (unfilled blocks, retrieve errors) is the
worker's business; this module only holds the futures.

Called from vLLM's model-runner thread only; the client settles the futures on its own thread,
and nothing of this module runs there.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from kvcache.integrations.vllm.plan import RetrieveSpec
from kvcache.protocol import messages as m


@dataclass(slots=True)
class SettledRetrieve:
    """A retrieve whose copy is over: ``got`` tokens valid (the ``skip_tokens`` prefix counts),
    or ``error`` when the call failed (nothing it copied can be trusted). ``num_bytes`` and
    ``seconds`` are the daemon's figures for its copy (0 when the call failed)."""

    spec: RetrieveSpec
    got: int
    error: BaseException | None
    num_bytes: int = 0
    seconds: float = 0.0


def settle_retrieve(spec: RetrieveSpec, future: Future[m.RetrieveResult]) -> SettledRetrieve:
    """What a finished retrieve's future says."""
    exc = future.exception()
    if exc is not None:
        return SettledRetrieve(spec, spec.skip_tokens, exc)
    return retrieved(spec, future.result())


def retrieved(spec: RetrieveSpec, reply: m.RetrieveResult) -> SettledRetrieve:
    """What the daemon's reply to a retrieve says."""
    return SettledRetrieve(spec, reply.retrieved_tokens, None, reply.num_bytes, reply.transfer_seconds)


@dataclass(slots=True)
class _Retrieving:
    spec: RetrieveSpec
    future: Future[m.RetrieveResult]


class RetrievesInFlight:
    """Issued asynchronous retrieves, by request, until ``settled`` hands them out."""

    def __init__(self) -> None:
        self._by_req: dict[str, list[_Retrieving]] = {}

    def add(self, spec: RetrieveSpec, future: Future[m.RetrieveResult]) -> None:
        self._by_req.setdefault(spec.req_id, []).append(_Retrieving(spec, future))

    def settled(self) -> tuple[list[SettledRetrieve], set[str]]:
        """Every retrieve that has settled since the last call, and the requests left with none
        in flight (those vLLM may now be told about)."""
        out: list[SettledRetrieve] = []
        done_reqs: set[str] = set()
        for req_id in list(self._by_req):
            retrieves = self._by_req[req_id]
            pending = [x for x in retrieves if not x.future.done()]
            for x in retrieves:
                if x.future.done():
                    out.append(settle_retrieve(x.spec, x.future))
            if pending:
                self._by_req[req_id] = pending
            else:
                del self._by_req[req_id]
                done_reqs.add(req_id)
        return out, done_reqs

    def wait(self, req_ids: Iterable[str] | None, timeout_s: float | None, *, first: bool = False) -> bool:
        """Wait (at most ``timeout_s``; None: until each call's own deadline, the client bounds
        every call) until the retrieves of ``req_ids`` (None: all), or with ``first`` any one of
        them, have settled; True if they have (or there are none)."""
        wanted = self._by_req if req_ids is None else {r: self._by_req.get(r, []) for r in req_ids}
        futures = [x.future for retrieves in wanted.values() for x in retrieves]
        if not futures:
            return True
        when = concurrent.futures.FIRST_COMPLETED if first else concurrent.futures.ALL_COMPLETED
        done, pending = concurrent.futures.wait(futures, timeout=timeout_s, return_when=when)
        return bool(done) if first else not pending

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._by_req

    def __len__(self) -> int:
        """Retrieves whose future has not settled yet."""
        return sum(1 for retrieves in self._by_req.values() for x in retrieves if not x.future.done())


__all__ = ["RetrievesInFlight", "SettledRetrieve", "retrieved", "settle_retrieve"]
