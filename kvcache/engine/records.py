"""What an engine operation's copies moved (``CopyTally``). Its result records
(``StoreResult``, ``RetrieveResult``) are shared with the wire: they live in ``kvcache.records``.

Separate so that the paths that fill them (``store``, ``retrieve``) and the module that reports
them (``op_events``) both import this leaf, instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.transfer.base import TransferResult


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


__all__ = ["CopyTally"]
