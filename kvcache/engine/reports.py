"""Checks on the engine's bookkeeping reports (block allocations) before they are published.

Separate from the facade because it is pure validation with no engine state: subscribers keep
state per (instance, block) and per record, which stays bounded only if a report is, so every
report passes here first, and the facade stays a facade.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.errors import BlockIdError, LimitExceededError
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


__all__ = ["check_allocation_report"]
