"""Ids: token and block ids as one int64 array type, converted and checked once.

A leaf of its own so that the request value (``request``), the engine and the transfer
boundary name one id-array type and share one check. A request's block ids are checked against
the instance's ``num_blocks`` when the request is built; the transfer handler recognises them
by their type (``Ids`` with a ``bound``) instead of checking again, and checks with the same
function only the ids a caller hands the transfer layer directly. The native copy re-checks
every id as defence in depth. On the wire, ids travel packed (``protocol.messages.IdArray``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeGuard, cast, runtime_checkable

import numpy as np
import torch

from kvcache.errors import BlockIdError, LimitExceededError


@runtime_checkable
class Packed(Protocol):
    """Ids packed little-endian, ``width`` bytes each, as the wire carries them
    (``protocol.messages.IdArray``, built by ``protocol.codec.pack_ids``)."""

    @property
    def data(self) -> bytes: ...
    @property
    def width(self) -> Literal[4, 8]: ...


RawIds = Sequence[int] | np.ndarray | torch.Tensor
"""Ids as a caller holds them: a list, a numpy array or a CPU tensor of ints."""

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Ids:
    """Checked ids: ``values`` is one-dimensional, contiguous, read-only int64.

    ``bound``: block ids were checked to lie in ``[0, bound)``; None for token ids (any
    int64). Build one with ``Ids.tokens`` or ``Ids.blocks``, never from unchecked values: the
    transfer layer trusts a ``bound`` it finds. A slice is checked too (it keeps the bound).
    """

    values: np.ndarray
    bound: int | None = None

    @classmethod
    def tokens(cls, raw: RawIds, *, max_ids: int | None = None) -> Ids:
        """Token ids as int64; ``TypeError`` for ids that are not integers, ``ValueError``
        for an array that is not one-dimensional, ``OverflowError`` past int64."""
        check_count(raw, max_ids)
        arr = _as_array(raw)
        if arr.size == 0:
            return cls(_frozen(np.zeros(0, np.int64), raw))
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
            raise OverflowError("token ids must fit int64")
        return cls(_frozen(arr, raw))

    @classmethod
    def blocks(cls, raw: RawIds, num_blocks: int, *, max_ids: int | None = None) -> Ids:
        """Block ids as int64, each checked to lie in ``[0, num_blocks)`` (``BlockIdError``)."""
        check_count(raw, max_ids)
        return cls(_frozen(block_id_array(raw, num_blocks), raw), num_blocks)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, where: slice) -> Ids:
        return Ids(self.values[where], self.bound)

    def runs(self, starts: Sequence[int], length: int) -> Ids:
        """The ids of ``[start, start + length)`` for each start, one after the other."""
        picked = np.concatenate([self.values[s : s + length] for s in starts])
        return Ids(_frozen(picked, None), self.bound)


_PACKED_TYPES: dict[type, bool] = {}


def is_packed(raw: object) -> TypeGuard[Packed]:
    """``isinstance(raw, Packed)``, remembered per type: a runtime protocol check walks the
    protocol's attributes each time (microseconds), and every request's ids pass here, once
    per item of a batched lookup."""
    kind = type(raw)
    known = _PACKED_TYPES.get(kind)
    if known is None:
        known = _PACKED_TYPES[kind] = isinstance(raw, Packed)
    return known


def id_count(raw: RawIds | Packed) -> int:
    """How many ids ``raw`` holds, packed or not."""
    return len(raw.data) // raw.width if is_packed(raw) else len(cast(RawIds, raw))


def check_count(raw: RawIds | Packed, max_ids: int | None) -> None:
    """Refuse more ids than ``max_ids`` (the daemon's ``--max-ids``) before converting any."""
    count = id_count(raw)
    if max_ids is not None and count > max_ids:
        raise LimitExceededError(f"{count} ids in one request; the limit is {max_ids} (--max-ids)")


def checked_packed(raw: Packed, max_ids: int | None) -> Packed:
    """``raw`` after ``check_count`` and the check ``unpacked`` makes (``ValueError`` on a
    ragged buffer), left packed: a batched lookup hashes uint32 ids as they came."""
    check_count(raw, max_ids)
    return _whole(raw)


def _whole(raw: Packed) -> Packed:
    """``raw``, or ``ValueError`` for a buffer that is not a whole number of ids."""
    if len(raw.data) % raw.width:
        raise ValueError(f"{len(raw.data)} bytes are not a whole number of {raw.width}-byte ids")
    return raw


def unpacked(raw: RawIds | Packed) -> RawIds:
    """Packed ids as a read-only numpy array (no copy; ``ValueError`` on a ragged buffer),
    anything else as it is."""
    if not is_packed(raw):
        return cast(RawIds, raw)
    _whole(raw)
    return np.frombuffer(raw.data, dtype="<u4" if raw.width == 4 else "<i8")


def block_id_array(block_ids: Ids | RawIds, num_blocks: int) -> np.ndarray:
    """``block_ids`` as contiguous int64, each checked to lie in ``[0, num_blocks)``: the one
    Python check of block ids.

    Raises ``BlockIdError`` for ids that are not integers (floats would be truncated
    silently), not one-dimensional, or out of range, naming the first bad position.
    """
    if isinstance(block_ids, Ids):
        block_ids = block_ids.values
    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise BlockIdError(f"block ids must be integers, got a {block_ids.dtype} tensor")
        arr = block_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(block_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise BlockIdError(f"block ids must be integers that fit int64, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise BlockIdError(f"block_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):  # two reductions, no mask: the
        bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))  # common case stays cheap
        pos = int(bad[0])
        raise BlockIdError(
            f"block id {int(arr[pos])} at position {pos} is outside [0, {num_blocks}); nothing was copied"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_array(raw: RawIds) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        return raw.detach().cpu().numpy()
    return np.asarray(raw)


def _frozen(arr: np.ndarray, caller: object) -> np.ndarray:
    """``arr`` as contiguous int64 that nobody can change after it was checked: copied when
    it is (or views) memory someone else holds (``caller``'s array or tensor), so the caller
    keeps a writable array of its own; made read-only in place when it is ours alone."""
    out = np.ascontiguousarray(arr, dtype=np.int64)
    if out.flags.writeable:
        if out is caller or out.base is not None:
            out = out.copy()
        out.flags.writeable = False
    return out


__all__ = ["Ids", "Packed", "RawIds", "block_id_array", "check_count", "unpacked"]
