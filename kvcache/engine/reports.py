"""The engine's bookkeeping reports (block allocations, ends of requests): checked, then published.

Separate from the facade because it is pure validation with no engine state: subscribers keep
state per (instance, block) and per record, which stays bounded only if a report is, so every
report passes here first, and the facade stays a facade.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.engine.instance import InstanceState
from kvcache.errors import BlockIdError, LimitExceededError
from kvcache.observability.event import Event, EventSink, EventType, MpVllmBlockAllocation, MpVllmEndSession
from kvcache.records import BlockAllocationRecord


def check_allocation_report(
    instance_id: int, num_blocks: int, limit: int, records: Sequence[BlockAllocationRecord]
) -> None:
    """Refuse the whole report on its first bad part: more than ``limit`` records or a record
    with more new blocks than the cache has (``LimitExceededError``), a block id outside
    ``[0, num_blocks)`` (``BlockIdError``). Any thread; reads nothing but its arguments."""
    if len(records) > limit:
        raise LimitExceededError(
            f"{len(records)} records in one allocation report of instance {instance_id}; "
            f"the limit is {limit} (max_report_records); report refused"
        )
    for record in records:
        ids = record.new_block_ids
        if ids and (min(ids) < 0 or max(ids) >= num_blocks):  # builtins: fast on many ids
            bad = next(b for b in ids if not 0 <= b < num_blocks)
            raise BlockIdError(
                f"block id {bad} in the allocation report of request {record.req_id!r} is "
                f"outside [0, {num_blocks}) of instance {instance_id}; report refused"
            )
        if len(ids) > num_blocks:  # valid ids, repeated: still more than a request can get
            raise LimitExceededError(
                f"request {record.req_id!r} reports {len(ids)} new blocks; "
                f"instance {instance_id} has {num_blocks}; report refused"
            )


def publish_allocations(
    bus: EventSink, inst: InstanceState, max_records: int, records: list[BlockAllocationRecord]
) -> None:
    """Publish an engine's block allocations for lifecycle tracking.

    The whole report is checked before anything is published, and one bad part refuses it
    all: a block id outside the registered cache (``BlockIdError``), more records than
    ``max_records`` or a record with more new blocks than the cache has
    (``LimitExceededError``). Subscribers keep state per (instance, block) and per record,
    which stays bounded only if these are."""
    check_allocation_report(inst.instance_id, inst.ctx.num_blocks, max_records, records)
    meta = MpVllmBlockAllocation(
        instance_id=inst.instance_id,
        model_name=inst.model_name,
        records=list(records),
        block_size=inst.ctx.block_size,  # lets L0 lifecycle tell the blocks of a record apart
    )
    bus.publish(Event(EventType.MP_VLLM_BLOCK_ALLOCATION, meta))


def publish_end_session(bus: EventSink, inst: InstanceState, request_id: str) -> None:
    """Publish that a request ended (its lifecycle subscribers close its session)."""
    meta = MpVllmEndSession(instance_id=inst.instance_id, model_name=inst.model_name, request_id=request_id)
    bus.publish(Event(EventType.MP_VLLM_END_SESSION, meta, session_id=request_id))


__all__ = ["check_allocation_report", "publish_allocations", "publish_end_session"]
