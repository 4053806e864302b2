"""What must hold of vLLM's scheduler after every step of every harness scenario (vLLM venv).

A request the scheduler holds (``Scheduler.requests``) is in exactly one place: running
(``running``), queued (``waiting``, or ``kv_holding_waiting`` for one that holds KV blocks,
loading ones included), or finished and kept only until the connector releases its blocks (in
no queue). A request in none of them, or in two, is in limbo: nothing would ever schedule it,
or it would be scheduled twice. ``check_no_limbo`` runs after each step (``Engine.run``).

A request can also be queued and still left behind (queued forever, never admitted): that
is a hang, not limbo, and ``Engine.run``'s wall-clock bound catches it, failing with
``describe_unfinished``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

RUN_BOUND_S = 60.0
"""Wall-clock bound of one ``Engine.run``: every scenario's requests finish in seconds; one that
is still unfinished after a minute was left behind (the hang of issue 26 stepped idly for as
long as it was let)."""


def _places(scheduler: Any) -> dict[str, list[str]]:
    """Request id -> the scheduler's places (queues) that hold it."""
    places: dict[str, list[str]] = {}
    for name in ("running", "waiting", "kv_holding_waiting"):
        for request in getattr(scheduler, name):
            places.setdefault(request.request_id, []).append(name)
    return places


def check_no_limbo(scheduler: Any, step: int) -> None:
    """Every request the scheduler holds is running, queued, or finished; none is in two
    places, and every queued or running request is one the scheduler holds."""
    places = _places(scheduler)
    held = scheduler.requests
    strays = sorted(set(places) - set(held))
    assert not strays, f"step {step}: {strays} queued or running but not held by the scheduler"
    for req_id, request in held.items():
        where = places.get(req_id, [])
        status = request.status
        if RequestStatus.is_finished(status):
            ok = not where
        elif status == RequestStatus.RUNNING:
            ok = where == ["running"]
        else:
            ok = len(where) == 1 and where[0] != "running"
        assert ok, f"step {step}: {req_id} is in limbo: {_state(scheduler, request, where)}"


def _state(scheduler: Any, request: Any, where: list[str]) -> str:
    try:
        (blocks,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    except Exception:  # not allocated (vLLM raises on an unknown id in some versions)
        blocks = []
    return (
        f"status {request.status.name}, places {where or 'none'}, "
        f"{request.num_computed_tokens} of {request.num_tokens} tokens computed, {len(blocks)} blocks held, "
        f"in flight as a prefill: {request in getattr(scheduler, '_inflight_prefills', ())}"
    )


def describe_unfinished(scheduler: Any) -> str:
    """Every request still held, with its state, and the free blocks: why nothing ran."""
    places = _places(scheduler)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    rows = [f"{r}: {_state(scheduler, q, places.get(r, []))}" for r, q in scheduler.requests.items()]
    return f"{free} blocks free; " + "; ".join(rows)


__all__ = ["RUN_BOUND_S", "check_no_limbo", "describe_unfinished"]
