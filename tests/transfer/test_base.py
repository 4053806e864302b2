"""The contract's records: what a result says, and the handler's context-manager form."""

from __future__ import annotations

from kvcache.errors import BlockIdError
from kvcache.transfer import CpuTransferHandler, Direction, TransferJob, TransferResult
from tests.transfer.helpers import make_context, page_table


def test_result_ok_follows_error() -> None:
    assert TransferResult(0, Direction.TO_CHUNKS, 4, 1024, 0.5).ok
    failed = TransferResult(1, Direction.FROM_CHUNKS, 0, 0, 0.0, BlockIdError("bad"))
    assert not failed.ok and isinstance(failed.error, BlockIdError)


def test_directions_name_the_offload_metrics() -> None:
    assert Direction.TO_CHUNKS.value == "store" and Direction.FROM_CHUNKS.value == "retrieve"


def test_handler_closes_on_leaving_a_with_block() -> None:
    ctx = make_context()
    with CpuTransferHandler(page_table(ctx), ctx.geometry, owners=ctx.tensors) as h:
        job = TransferJob(Direction.TO_CHUNKS, [0, 1, 2, 3], tuple(ctx.allocate_chunks(1)))
        job_id = h.submit(job)
    (result,) = h.wait([job_id])  # close drained it; the result stays collectable
    assert result.ok
