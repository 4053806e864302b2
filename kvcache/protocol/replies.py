"""The daemon's replies: one msgspec Struct per result, and the error record.

The requests are in ``messages``, which re-exports everything here, so a reader (and every
caller, as ``messages.Error``) still finds the whole vocabulary through one name; apart
because a reply is what the daemon promises and a request what it must check, and each list
grows on its own. ``Reply`` (the base, tagged by ``kind``), ``StoreResult`` and
``RetrieveResult`` live in ``kvcache.records``: the engine resolves its futures with them and
the daemon sends them as they are.
"""

from __future__ import annotations

from typing import Any

from kvcache.errors import ErrorCode
from kvcache.protocol.wire import Wire as _Wire
from kvcache.records import LookupHit, Reply, RetrieveResult, StoreResult


class Error(Reply, tag="error"):
    """A typed failure: ``code`` for programs, ``message`` for people (never a traceback)."""

    code: ErrorCode
    message: str


class Registered(Reply, tag="registered"):
    """``heartbeat_timeout_s``: the client must send something at least this often."""

    instance_id: int
    num_layers: int
    num_blocks: int
    block_size: int
    chunk_size: int
    fmt: str
    heartbeat_timeout_s: float
    token: bytes = b""
    """The registration token: every later request for this instance must carry it."""


class Done(Reply, tag="done"):
    """Success of an operation that returns nothing (unregister, reports, end session)."""


class LookupResult(Reply, tag="lookup"):
    """``l2_hit_tokens``: how much of the hit is in L2 (being loaded into L1 now)."""

    hit_tokens: int
    l2_hit_tokens: int = 0


class LookupBatchResult(Reply, tag="lookup_batch"):
    """The answers to a ``LookupBatch``, one per item, in its order."""

    hits: list[LookupHit]


class StatusResult(Reply, tag="status"):
    """Daemon health: the engine's own ``status()`` dict plus what the daemon knows."""

    protocol_version: int
    pid: int
    uptime_s: float
    instances: list[int]
    engine: dict[str, Any]
    in_flight: int = 0
    """Requests of registered instances queued or running on the worker threads."""


class Pong(Reply, tag="pong"):
    """``registered``: whether the pinged instance is known (False after a daemon restart)."""

    protocol_version: int
    registered: bool = False
    fd_socket: str = ""
    """Path of the daemon's Unix socket for handing over memfds (empty: CPU tensors unsupported)."""


class PageExistsResult(Reply, tag="page_exists"):
    """``hit_pages``: the leading pages held; ``l2_pages`` of them are loading from L2."""

    hit_pages: int
    l2_pages: int = 0


ReplyBody = (
    Error
    | Registered
    | Done
    | LookupResult
    | StoreResult
    | RetrieveResult
    | StatusResult
    | Pong
    | PageExistsResult
    | LookupBatchResult
)


class ReplyEnvelope(_Wire):
    v: int
    id: int
    body: ReplyBody


__all__ = [
    "Done",
    "Error",
    "LookupBatchResult",
    "LookupHit",
    "LookupResult",
    "PageExistsResult",
    "Pong",
    "Registered",
    "ReplyBody",
    "ReplyEnvelope",
    "StatusResult",
]
