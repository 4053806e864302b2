"""The daemon's wire vocabulary: one msgspec Struct per request, one per result, one error record.

Kept apart from the codec and the server so that a reader sees the whole protocol in one
file, and so that a client can import it without pulling in the daemon.

Every frame is a MessagePack map: ``RequestEnvelope(v, id, body)`` from a client,
``ReplyEnvelope(v, id, body)`` from the daemon. ``body`` is a tagged union (tag field ``op``
for requests, ``kind`` for replies), so the decoder picks the class and nobody writes a type
switch. The schema only grows: new fields go last and carry defaults; ``PROTOCOL_VERSION``
changes only when an old peer could misread a new message.

NOTE: nothing here is ever pickled. Tensors travel as typed descriptors (a shared-memory
file + shape/stride/dtype/offset, or CUDA IPC handle bytes + device UUID), never as objects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvcache.errors import ErrorCode  # re-exported: the wire vocabulary names it
from kvcache.records import BlockAllocationRecord

PROTOCOL_VERSION = 2
"""Bumped only on a change an older peer would misread; a mismatch is a ``VERSION_MISMATCH`` reply.

2: registration tokens on every instance request; CPU tensors travel as sealed memfds
(``FdTensor``) instead of /dev/shm paths."""

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""The default request cap (token lists of ~10M ids fit). The daemon closes a connection whose
frame announces more (``ZMQ_MAXMSGSIZE``); ``decode_request`` answers ``TOO_LARGE`` to a
whole frame over its cap."""

MAX_LOOKUP_BATCH = 256
"""Most lookups one ``LookupBatch`` carries; the decoder refuses a longer list (``BAD_MESSAGE``)
before a handler sees it. A scheduler step rarely admits more requests than this; a client
with more sends several batches."""

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TensorNesting = Literal["tensor", "list", "nested"]
"""How the engine's ``kv_caches`` object nests its tensors: one tensor, a list, or a list of lists."""


class _Wire(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=False):
    """Common options: defaults stay off the wire, no GC tracking, unknown fields ignored."""


# -- tensor descriptors ------------------------------------------------------------------


class FdTensor(_Wire, tag="fd", tag_field="via"):
    """A CPU tensor inside a sealed memfd that the engine handed to the daemon.

    The descriptors themselves never travel in a ZMQ frame: the client sends them beforehand
    over the daemon's Unix fd socket (``SCM_RIGHTS``) under a random ``Register.fd_ticket``;
    ``fd_index`` names one of the descriptors sent under that ticket. ``offset`` is the byte
    offset of element 0 inside the memfd; ``stride`` is in elements. No path is ever named,
    so a client cannot make the daemon open, map or delete a file of its choosing.
    """

    fd_index: NonNegInt
    offset: NonNegInt
    shape: list[NonNegInt]
    stride: list[NonNegInt]
    dtype: str


class CudaIpcTensor(_Wire, tag="cuda_ipc", tag_field="via"):
    """A GPU tensor shared by CUDA IPC: the handle bytes plus typed fields, never a pickle.

    The fields mirror what ``torch.UntypedStorage._share_cuda_`` returns; ``device_uuid``
    replaces the ordinal because the two processes may number their GPUs differently.
    ``storage_offset`` and ``stride`` are in elements, like ``Tensor.as_strided``. torch's
    reference-counter file name and offset are not sent: the daemon never opens a
    shared-memory name a client chose (see ``kvcache.server.ipc.NO_REF_COUNTER``).
    """

    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: NonNegInt
    storage_offset_bytes: NonNegInt
    event_handle: bytes
    event_sync_required: bool
    storage_offset: NonNegInt
    shape: list[NonNegInt]
    stride: list[NonNegInt]
    dtype: str


TensorDesc = FdTensor | CudaIpcTensor


class IdArray(_Wire, array_like=True):
    """Integer ids (tokens, block ids) packed little-endian, ``width`` bytes each.

    ``width`` 4 is uint32 (every vocabulary and block table in practice), 8 is int64. A 1k-token
    prompt decodes in about a microsecond this way, against ~16 us as a MessagePack list of ints,
    and the engine hashes the bytes without building Python ints. Build one with
    ``kvcache.protocol.codec.pack_ids``.
    """

    data: bytes
    width: Literal[4, 8] = 4


# -- requests ----------------------------------------------------------------------------


class Request(_Wire, tag_field="op"):
    """Base of every request; the concrete class names the operation."""


class Register(Request, tag="register"):
    """Map an engine's KV tensors into the daemon and register them with the cache engine.

    ``tensors`` are the leaves of ``kv_caches`` in order; ``nesting`` and ``group_sizes``
    rebuild its shape (``nested``: ``group_sizes[i]`` tensors in sub-list ``i``).
    """

    instance_id: NonNegInt
    model_name: str
    tensors: list[TensorDesc]
    nesting: TensorNesting = "list"
    group_sizes: list[NonNegInt] = []
    engine: str = "vllm"
    fmt: str | None = None
    block_size: int | None = None
    fd_ticket: bytes = b""
    """The ticket the ``FdTensor`` descriptors were sent under (empty for CUDA tensors)."""
    client_nonce: bytes = b""
    """A random value fixed for the life of one client object: re-registering a live instance
    id is allowed only with the nonce of the registration it replaces (the same client)."""


class Unregister(Request, tag="unregister"):
    instance_id: NonNegInt
    token: bytes = b""


class Lookup(Request, tag="lookup"):
    instance_id: NonNegInt
    token_ids: IdArray
    cache_salt: str = ""
    request_id: str = ""
    token: bytes = b""
    key_extra: str = ""
    """What besides the tokens decides the KV (LoRA adapter, multimodal inputs, ...), as the
    engine states it; chunks are keyed by it too. Not a tenant namespace: ``cache_salt`` is."""


class LookupItem(_Wire):
    """One request's lookup inside a ``LookupBatch``: the fields of ``Lookup`` that belong to
    the request, not to the instance."""

    token_ids: IdArray
    cache_salt: str = ""
    request_id: str = ""
    key_extra: str = ""


class LookupBatch(Request, tag="lookup_batch"):
    """Several lookups of one instance in one round trip (the requests a scheduler step must
    ask about). Every item is checked as a ``Lookup`` is (ids bounded by ``--max-ids``, its
    salt allowed to the tenant) before any is served: one bad item refuses the batch, and
    nothing is looked up or prefetched. The answer is a ``LookupBatchResult``, in item order."""

    instance_id: NonNegInt
    items: Annotated[list[LookupItem], msgspec.Meta(min_length=1, max_length=MAX_LOOKUP_BATCH)]
    token: bytes = b""


class Store(Request, tag="store"):
    """Copy the engine blocks holding ``token_ids`` (in token order) into the cache.

    ``cuda_event`` is an interprocess event the engine recorded after writing those blocks;
    the daemon waits on it before reading them.
    """

    instance_id: NonNegInt
    token_ids: IdArray
    block_ids: IdArray
    cache_salt: str = ""
    request_id: str = ""
    block_hashes: list[int] | None = None
    cuda_event: bytes | None = None
    token: bytes = b""
    deadline_ms: NonNegInt = 0
    """Unix time (ms) at which the client stops waiting; 0 = none. The daemon moves no byte
    after it (less a safety margin), so a late copy never lands on reused engine blocks."""
    key_extra: str = ""
    """What besides the tokens decides the KV (LoRA adapter, multimodal inputs, ...), as the
    engine states it; chunks are keyed by it too. Not a tenant namespace: ``cache_salt`` is."""


class Retrieve(Request, tag="retrieve"):
    instance_id: NonNegInt
    token_ids: IdArray
    block_ids: IdArray
    skip_tokens: NonNegInt = 0
    cache_salt: str = ""
    request_id: str = ""
    token: bytes = b""
    deadline_ms: NonNegInt = 0
    """Unix time (ms) at which the client stops waiting; 0 = none. The daemon moves no byte
    after it (less a safety margin), so a late copy never lands on reused engine blocks."""
    key_extra: str = ""
    """What besides the tokens decides the KV (LoRA adapter, multimodal inputs, ...), as the
    engine states it; chunks are keyed by it too. Not a tenant namespace: ``cache_salt`` is."""


class ReportBlockAllocations(Request, tag="report_block_allocations"):
    instance_id: NonNegInt
    records: list[BlockAllocationRecord]
    token: bytes = b""


class EndSession(Request, tag="end_session"):
    instance_id: NonNegInt
    request_id: str
    token: bytes = b""


class Status(Request, tag="status"):
    pass


class Ping(Request, tag="ping"):
    """Health check and heartbeat: a ping naming an instance (with its token) keeps its
    registration alive."""

    instance_id: int | None = None
    token: bytes = b""


RequestBody = (
    Register | Unregister | Lookup | Store | Retrieve | ReportBlockAllocations | EndSession | Status
    | Ping | LookupBatch
)


class RequestEnvelope(_Wire):
    v: int
    id: int
    body: RequestBody


class RequestHeader(_Wire):
    """What the daemon can still read from a request whose body it cannot decode."""

    v: int
    id: int = 0


# -- replies -----------------------------------------------------------------------------


class Reply(_Wire, tag_field="kind"):
    """Base of every reply: a result of the request's operation, or an ``Error``."""


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


class LookupHit(_Wire, array_like=True):
    """One item's answer in a ``LookupBatchResult``: the fields of ``LookupResult``."""

    hit_tokens: int
    l2_hit_tokens: int = 0


class LookupBatchResult(Reply, tag="lookup_batch"):
    """The answers to a ``LookupBatch``, one per item, in its order."""

    hits: list[LookupHit]


class StoreResult(Reply, tag="store"):
    """``num_bytes`` / ``transfer_seconds``: what the daemon's copies of this store moved and
    how long they ran (from its transfer records), so an engine reports offload statistics
    from the one source the daemon's own metrics use."""

    stored_chunks: int
    skipped_chunks: int
    failed_chunks: int
    stored_tokens: int
    num_bytes: NonNegInt = 0
    transfer_seconds: float = 0.0


class RetrieveResult(Reply, tag="retrieve"):
    """``cuda_event``: an interprocess event the engine waits on before reusing the blocks.

    Today's daemon sends none: its copy has completed when it replies. An asynchronous
    retrieve that sends one must keep the event alive until the engine says it waited
    (destroying an exported event the peer still uses is undefined behaviour in CUDA IPC).
    """

    retrieved_tokens: int
    cuda_event: bytes | None = None
    num_bytes: NonNegInt = 0
    """As on ``StoreResult``."""
    transfer_seconds: float = 0.0


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


ReplyBody = (
    Error | Registered | Done | LookupResult | StoreResult | RetrieveResult | StatusResult | Pong
    | LookupBatchResult
)


class ReplyEnvelope(_Wire):
    v: int
    id: int
    body: ReplyBody


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_LOOKUP_BATCH",
    "PROTOCOL_VERSION",
    "CudaIpcTensor",
    "Done",
    "EndSession",
    "Error",
    "ErrorCode",
    "FdTensor",
    "IdArray",
    "Lookup",
    "LookupBatch",
    "LookupBatchResult",
    "LookupHit",
    "LookupItem",
    "LookupResult",
    "Ping",
    "Pong",
    "Register",
    "Registered",
    "Reply",
    "ReplyBody",
    "ReplyEnvelope",
    "ReportBlockAllocations",
    "Request",
    "RequestBody",
    "RequestEnvelope",
    "RequestHeader",
    "Retrieve",
    "RetrieveResult",
    "Status",
    "StatusResult",
    "Store",
    "StoreResult",
    "TensorDesc",
    "TensorNesting",
    "Unregister",
]
