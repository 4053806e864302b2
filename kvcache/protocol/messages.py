"""The daemon's wire vocabulary: one msgspec Struct per request (the replies: ``replies``).

Kept apart from the codec and the server so that a reader sees the whole protocol through
one name (the replies are defined in ``replies`` and re-exported here), and so that a client
can import it without pulling in the daemon.

Every frame is a MessagePack map: ``RequestEnvelope(v, id, body)`` from a client,
``ReplyEnvelope(v, id, body)`` from the daemon. ``body`` is a tagged union (tag field ``op``
for requests, ``kind`` for replies), so the decoder picks the class and nobody writes a type
switch. The schema only grows: new fields go last and carry defaults; ``PROTOCOL_VERSION``
changes only when an old peer could misread a new message.

NOTE: nothing here is ever pickled. Tensors travel as typed descriptors (a shared-memory
file + shape/stride/dtype/offset, or CUDA IPC handle bytes + device UUID), never as objects.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvcache.errors import ErrorCode  # re-exported: the wire vocabulary names it
from kvcache.protocol.replies import (  # the replies: one vocabulary, one import
    Done,
    Error,
    LookupBatchResult,
    LookupHit,
    LookupResult,
    PageExistsResult,
    Pong,
    Registered,
    ReplyBody,
    ReplyEnvelope,
    StatusResult,
)
from kvcache.protocol.wire import CudaIpcTensor, FdTensor, IdArray, NonNegInt, TensorDesc
from kvcache.protocol.wire import Wire as _Wire
from kvcache.records import (  # the replies the engine's futures resolve with, re-exported
    BlockAllocationRecord,
    Name,
    Reply,
    RetrieveResult,
    StoreResult,
)

PROTOCOL_VERSION = 3
"""Bumped only on a change an older peer would misread; a mismatch is a ``VERSION_MISMATCH`` reply.

2: registration tokens on every instance request; CPU tensors travel as sealed memfds
(``FdTensor``) instead of /dev/shm paths.
3: ``LookupItem.head`` (an older daemon would ignore it and look up only the tail)."""

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""The default request cap (token lists of ~10M ids fit). The daemon closes a connection whose
frame announces more (``ZMQ_MAXMSGSIZE``); ``decode_request`` answers ``TOO_LARGE`` to a
whole frame over its cap."""

MAX_LOOKUP_BATCH = 256
"""Most lookups one ``LookupBatch`` carries; the decoder refuses a longer list (``BAD_MESSAGE``)
before a handler sees it. A scheduler step rarely admits more requests than this; a client
with more sends several batches."""

MAX_REGISTER_TENSORS = 16384
"""Most tensor descriptors (and groups) one ``Register`` carries: the ceiling of the daemon's
``--max-tensors``. Lists of structs cost the decoder microseconds an item, and it runs on
the daemon's I/O thread before anyone checks the sender: unbounded, one frame within the
message cap would hold every client's replies for seconds."""

MAX_REPORT_RECORDS = 16384
"""Most records one ``ReportBlockAllocations`` carries (decoded as ``MAX_REGISTER_TENSORS``
says); a step reports one per request given blocks, and the engine's ``max_report_records``
may lower it."""

TensorNesting = Literal["tensor", "list", "nested"]
"""How the engine's ``kv_caches`` object nests its tensors: one tensor, a list, or a list of lists."""


# -- requests ----------------------------------------------------------------------------


class Request(_Wire, tag_field="op"):
    """Base of every request; the concrete class names the operation."""


class Register(Request, tag="register"):
    """Map an engine's KV tensors into the daemon and register them with the cache engine.

    ``tensors`` are the leaves of ``kv_caches`` in order; ``nesting`` and ``group_sizes``
    rebuild its shape (``nested``: ``group_sizes[i]`` tensors in sub-list ``i``).
    """

    instance_id: NonNegInt
    model_name: Name
    tensors: Annotated[list[TensorDesc], msgspec.Meta(max_length=MAX_REGISTER_TENSORS)]
    nesting: TensorNesting = "list"
    group_sizes: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_REGISTER_TENSORS)] = []
    engine: str = "vllm"
    fmt: str | None = None
    block_size: int | None = None
    fd_ticket: bytes = b""
    """The ticket the ``FdTensor`` descriptors were sent under (empty for CUDA tensors)."""
    client_nonce: bytes = b""
    """A random value fixed for the life of one client object: re-registering a live instance
    id is allowed only with the nonce of the registration it replaces (the same client)."""
    chunk_size: int | None = None
    """The instance's chunk size in tokens (a multiple of its block size, at most the daemon's);
    None: the daemon's. SGLang page instances pass their page size: one chunk per page."""


class Unregister(Request, tag="unregister"):
    instance_id: NonNegInt
    token: bytes = b""


class Lookup(Request, tag="lookup"):
    instance_id: NonNegInt
    token_ids: IdArray
    cache_salt: Name = ""
    request_id: Name = ""
    token: bytes = b""
    key_extra: str = ""
    """What besides the tokens decides the KV (LoRA adapter, multimodal inputs, ...), as the
    engine states it; chunks are keyed by it too. Not a tenant namespace: ``cache_salt`` is."""


class LookupItem(_Wire):
    """One request's lookup inside a ``LookupBatch``: the fields of ``Lookup`` that belong to
    the request, not to the instance."""

    token_ids: IdArray
    cache_salt: Name = ""
    request_id: Name = ""
    key_extra: str = ""
    head: NonNegInt = 0
    """Leading ids shared with the item before, left out of ``token_ids`` (``codec.with_heads``;
    ``codec.whole_ids`` adds them back and says what a head may be)."""


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
    cache_salt: Name = ""
    request_id: Name = ""
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
    cache_salt: Name = ""
    request_id: Name = ""
    token: bytes = b""
    deadline_ms: NonNegInt = 0
    """Unix time (ms) at which the client stops waiting; 0 = none. The daemon moves no byte
    after it (less a safety margin), so a late copy never lands on reused engine blocks."""
    key_extra: str = ""
    """What besides the tokens decides the KV (LoRA adapter, multimodal inputs, ...), as the
    engine states it; chunks are keyed by it too. Not a tenant namespace: ``cache_salt`` is."""
    await_chunks: NonNegInt = 0
    """Prefill/decode split: the leading chunks of ``token_ids`` another engine is storing
    (at most the full chunks ``token_ids`` holds). The daemon waits up to ``await_ms`` for
    them to be stored (capped by its ``retrieve_wait_timeout_s``), then copies what is READY."""
    await_ms: NonNegInt = 0


class ReportBlockAllocations(Request, tag="report_block_allocations"):
    instance_id: NonNegInt
    records: Annotated[list[BlockAllocationRecord], msgspec.Meta(max_length=MAX_REPORT_RECORDS)]
    token: bytes = b""


class EndSession(Request, tag="end_session"):
    instance_id: NonNegInt
    request_id: Name
    token: bytes = b""


class Status(Request, tag="status"):
    pass


class Ping(Request, tag="ping"):
    """Health check and heartbeat: a ping naming an instance (with its token) keeps its
    registration alive."""

    instance_id: int | None = None
    token: bytes = b""


PAGE_KEY_BYTES = 32
"""Bytes of one page key in ``PageExists.keys`` and the others (a SHA-256 digest)."""


class PageExists(Request, tag="page_exists"):
    """How many leading pages of ``keys`` the cache holds (SGLang HiCache ``batch_exists``).

    ``keys``: ``PAGE_KEY_BYTES`` bytes per page, concatenated, each naming a whole prefix (the
    engine chains them). Pages found in L2 start loading into L1, as a lookup's do."""

    instance_id: NonNegInt
    keys: bytes
    cache_salt: Name = ""
    token: bytes = b""


class PageSet(Request, tag="page_set"):
    """Copy the instance's blocks ``block_ids`` (one per key) into the cache under ``keys``."""

    instance_id: NonNegInt
    keys: bytes
    block_ids: IdArray
    cache_salt: Name = ""
    token: bytes = b""
    deadline_ms: NonNegInt = 0
    """As on ``Store``."""


class PageGet(Request, tag="page_get"):
    """Copy the cached leading pages of ``keys`` into ``block_ids`` (one per key)."""

    instance_id: NonNegInt
    keys: bytes
    block_ids: IdArray
    cache_salt: Name = ""
    token: bytes = b""
    deadline_ms: NonNegInt = 0
    """As on ``Retrieve``."""


RequestBody = (
    Register
    | Unregister
    | Lookup
    | Store
    | Retrieve
    | ReportBlockAllocations
    | EndSession
    | Status
    | Ping
    | PageExists
    | PageSet
    | PageGet
    | LookupBatch
)


class RequestEnvelope(_Wire):
    v: int
    id: int
    body: RequestBody


class RequestHeader(_Wire):
    """What the daemon can still read from a request whose body it cannot decode."""

    v: int
    id: int = 0


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_LOOKUP_BATCH",
    "MAX_REGISTER_TENSORS",
    "MAX_REPORT_RECORDS",
    "PAGE_KEY_BYTES",
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
    "PageExists",
    "PageExistsResult",
    "PageGet",
    "PageSet",
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
