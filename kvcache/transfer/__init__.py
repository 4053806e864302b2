"""Transfers: the one place that moves bytes between engine KV memory and chunks.

``base`` holds the contract (submit / poll / wait) and its records, ``validate`` the job
checks every backend shares, ``cpu`` and ``cuda`` one handler each. The CUDA handler is
imported only when a CUDA cache is registered (``kvcache.transfer.cuda``).
"""

from kvcache.geometry import Geometry
from kvcache.transfer.base import BlockIds, Direction, TransferHandler, TransferJob, TransferResult
from kvcache.transfer.cpu import CpuTransferHandler
from kvcache.transfer.validate import block_id_array

__all__ = [
    "BlockIds",
    "CpuTransferHandler",
    "Direction",
    "Geometry",
    "TransferHandler",
    "TransferJob",
    "TransferResult",
    "block_id_array",
]
