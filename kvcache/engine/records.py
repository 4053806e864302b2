"""The records one engine operation produces: what a store did, and what its copies moved.

Separate so that the paths that fill them (``store``, ``load``) and the module that reports
them (``op_events``) both import this leaf, instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvcache.transfer.base import TransferResult


class StoreResult(msgspec.Struct, frozen=True):
    """What a store did, in chunks; ``stored_tokens`` are the tokens newly written.
    ``num_bytes`` / ``transfer_seconds``: what its copies moved and how long they ran, from
    their ``TransferResult`` records (``CopyTally``), for callers that report offload
    statistics (the vLLM connector) without keeping figures of their own."""

    stored_chunks: int = 0
    skipped_chunks: int = 0
    failed_chunks: int = 0
    stored_tokens: int = 0
    num_bytes: int = 0
    transfer_seconds: float = 0.0


class RetrieveResult(msgspec.Struct, frozen=True):
    """What a retrieve did: ``retrieved_tokens`` is the prefix now valid in the engine's
    blocks (skip + copied); bytes and seconds as on ``StoreResult``."""

    retrieved_tokens: int = 0
    num_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(slots=True)
class CopyTally:
    """The bytes, seconds and blocks an operation's copies moved, summed from their
    ``TransferResult`` records: the one source of the offload statistics and of the
    ``num_bytes`` / ``transfer_seconds`` on the MP_*_END events, so the two never disagree.

    ``seconds`` is the copies' own time (not time spent queued behind other jobs); a failed
    copy adds the time it ran and no bytes.
    """

    nbytes: int = 0
    seconds: float = 0.0
    blocks: int = 0

    def add(self, result: TransferResult) -> None:
        self.nbytes += result.bytes
        self.seconds += result.seconds
        self.blocks += result.blocks


__all__ = ["CopyTally", "RetrieveResult", "StoreResult"]
