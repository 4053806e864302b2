"""``KVCacheClient``: the data API a serving engine calls, one client per engine instance.

Calls mirror ``CacheEngine`` (same arguments, same exceptions), so an engine can switch
between the in-process engine and the daemon. This module only turns each call into its
wire message and each reply into its result, and orders the engine's CUDA stream around the
daemon's copies (the events of ``transport.cuda_events``); delivering the messages, the
breaker, heartbeats and re-registration are the ``Session``'s (``client.session``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import torch

from kvcache.client.pipeline import DEFAULT_WINDOW
from kvcache.client.session import Registration, Session
from kvcache.errors import ProtocolError
from kvcache.futures import then
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.protocol.breaker import CircuitBreaker
from kvcache.protocol.codec import pack_ids
from kvcache.transport.cuda_events import EventKeeper, ExportedEvent, record_ipc_event, wait_ipc_event
from kvcache.transport.tensors import flatten_kv_caches


class KVCacheClient:
    """The engine-side handle on the daemon for one engine instance.

    Thread-safe: synchronous calls from several threads are serialised on one socket;
    ``*_async`` calls go through the background thread, up to ``window`` in flight.
    ``timeout_s`` bounds every call.
    ``session`` is the connection itself (``client.session.Session``).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        instance_id: int | None = None,
        model_name: str = "model",
        *,
        timeout_s: float = 10.0,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
        daemon_uid: int | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        """``endpoint``: default ``default_endpoint()`` (the local daemon's Unix socket).
        ``instance_id``: default a random id, unique per client (two engines on defaults
        never share one). ``curve_server_key`` / ``curve_secret_key``: for a daemon that
        requires CURVE (the daemon's public key; this client's ``.key_secret`` file).
        ``daemon_uid``: the uid the daemon runs as (default ``$KVCACHE_DAEMON_UID``, else
        this process's); an ``ipc://`` directory, peer or fd socket of another uid is refused
        with ``UntrustedPathError`` (here already, if the directory exists). ``window``: the
        asynchronous calls kept in flight at the daemon at most, answered in any order (1: one
        at a time, each waiting for the one before)."""
        self.session = Session(
            endpoint,
            instance_id if instance_id is not None else secrets.randbelow(1 << 31),
            timeout_s=timeout_s,
            curve_server_key=curve_server_key,
            curve_secret_key=curve_secret_key,
            daemon_uid=daemon_uid,
            window=window,
        )
        self.model_name = model_name
        self._nonce = secrets.token_bytes(16)  # proves "same client" when re-registering
        self._kv_caches: Any = None
        self._device = torch.device("cpu")
        self._events = EventKeeper()  # CUDA: a store's event outlives the daemon's wait on it

    @property
    def endpoint(self) -> str:
        return self.session.endpoint

    @property
    def instance_id(self) -> int:
        return self.session.instance_id

    @property
    def daemon_uid(self) -> int:
        return self.session.daemon_uid

    @property
    def timeout_s(self) -> float:
        return self.session.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.session.timeout_s = value

    @property
    def breaker(self) -> CircuitBreaker:
        """Open after a call timed out: calls fail at once until a background probe answers."""
        return self.session.breaker

    @property
    def dropped_notices(self) -> int:
        """Block reports and end-of-request notices dropped (daemon down, or too many queued)."""
        return self.session.dropped_notices

    # -- registration ------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: Any,
        engine: str = "vllm",
        block_size: int | None = None,
        fmt: Any = None,
        chunk_size: int | None = None,
    ) -> m.Registered:
        """Share the engine's KV tensors with the daemon (CPU: sealed memfds, GPU: CUDA IPC).

        ``kv_caches`` is one tensor, a list, or ``[K_list, V_list]``; CPU tensors must come
        from ``empty_shared``. ``fmt`` is a ``KVFormat`` (or its name) when detection
        from shapes is ambiguous. ``chunk_size``: smaller chunks than the daemon's (SGLang
        page instances: one page each).
        """
        leaves, nesting, groups = flatten_kv_caches(kv_caches)
        fmt_name = fmt if isinstance(fmt, str) or fmt is None else fmt.name
        msg = m.Register(
            instance_id=self.instance_id,
            model_name=self.model_name,
            tensors=[],
            nesting=nesting,
            group_sizes=groups,
            engine=engine,
            fmt=fmt_name,
            block_size=block_size,
            client_nonce=self._nonce,
            chunk_size=chunk_size,
        )
        reply = self.session.register(Registration(msg, leaves))
        self._device = leaves[0].device
        # Keep the tensors (and so their memfds) alive for re-registration after a daemon
        # restart, even if the caller drops its own references.
        self._kv_caches = kv_caches
        return reply

    def unregister(self) -> None:
        self.session.unregister()

    # -- data path ---------------------------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], *, cache_salt: str = "", request_id: str = "", key_extra: str = ""
    ) -> int:
        """Leading tokens of ``token_ids`` the cache holds (whole chunks).

        ``key_extra`` (here and in ``store``/``retrieve``): whatever besides the tokens decides
        the KV (a LoRA adapter, multimodal inputs); chunks are keyed by it too."""
        return self.lookup_tiers(
            token_ids, cache_salt=cache_salt, request_id=request_id, key_extra=key_extra
        ).hit_tokens

    def lookup_tiers(
        self, token_ids: Sequence[int], *, cache_salt: str = "", request_id: str = "", key_extra: str = ""
    ) -> m.LookupResult:
        """``lookup``, also saying how many of the hit tokens come from L2."""
        msg = m.Lookup(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            cache_salt=cache_salt,
            request_id=request_id,
            key_extra=key_extra,
        )
        return self.session.call(msg, m.LookupResult)

    def lookup_batch(self, items: Sequence[m.LookupItem]) -> list[m.LookupHit]:
        """One answer per item (say, every request a scheduler step admits), in order, in one
        round trip per ``MAX_LOOKUP_BATCH`` items; items are ``m.LookupItem(token_ids=
        pack_ids(tokens), ...)``. One refused item refuses its batch with a ``lookup``'s error."""
        hits: list[m.LookupHit] = []
        for start in range(0, len(items), m.MAX_LOOKUP_BATCH):
            part = list(items[start : start + m.MAX_LOOKUP_BATCH])
            msg = m.LookupBatch(instance_id=self.instance_id, items=part)
            got = self.session.call(msg, m.LookupBatchResult)
            if len(got.hits) != len(part):
                raise ProtocolError(f"the daemon answered {len(got.hits)} lookups for {len(part)} items")
            hits += got.hits
        return hits

    def _store_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        cache_salt: str,
        request_id: str,
        block_hashes: Sequence[int] | None,
        key_extra: str = "",
    ) -> tuple[m.Store, ExportedEvent | None]:
        """The message, and the CUDA event its handle names (held until ``_settled``)."""
        exported = record_ipc_event(self._device) if self._device.type == "cuda" else None
        if exported is not None:
            self._events.hold(exported)
        msg = m.Store(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            block_ids=pack_ids(block_ids),
            cache_salt=cache_salt,
            request_id=request_id,
            block_hashes=None if block_hashes is None else list(block_hashes),
            cuda_event=None if exported is None else exported.handle,
            key_extra=key_extra,
        )
        return msg, exported

    def _settled(self, exported: ExportedEvent | None) -> None:
        """The store's reply arrived or the call gave up: the event only lingers now."""
        if exported is not None:
            self._events.release(exported)

    def store(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        key_extra: str = "",
    ) -> m.StoreResult:
        """Copy the engine blocks ``block_ids`` (holding ``token_ids`` in order) into the cache."""
        msg, exported = self._store_msg(token_ids, block_ids, cache_salt, request_id, block_hashes, key_extra)
        try:
            return self.session.call(msg, m.StoreResult)
        finally:
            self._settled(exported)

    def store_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
        key_extra: str = "",
    ) -> Future[m.StoreResult]:
        msg, exported = self._store_msg(token_ids, block_ids, cache_salt, request_id, block_hashes, key_extra)
        future = self.session.submit(msg, m.StoreResult)
        future.add_done_callback(lambda _f: self._settled(exported))
        return future

    def _retrieve_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int,
        cache_salt: str,
        request_id: str,
        key_extra: str = "",
        awaited: tuple[int, int] = (0, 0),
    ) -> m.Retrieve:
        return m.Retrieve(
            instance_id=self.instance_id, token_ids=pack_ids(token_ids), block_ids=pack_ids(block_ids),
            skip_tokens=skip_tokens, cache_salt=cache_salt, request_id=request_id, key_extra=key_extra,
            await_chunks=awaited[0], await_ms=awaited[1],
        )  # fmt: skip

    def retrieve(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> int:
        """Copy cached chunks into ``block_ids``; returns the valid prefix length in tokens."""
        return self.retrieve_reply(
            token_ids, block_ids, skip_tokens, cache_salt=cache_salt, request_id=request_id,
            key_extra=key_extra,
        ).retrieved_tokens  # fmt: skip

    def retrieve_reply(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> m.RetrieveResult:
        """``retrieve`` with the daemon's whole reply (the copy's bytes and seconds too), on
        the caller's own channel: it never queues behind the asynchronous calls in flight."""
        msg = self._retrieve_msg(token_ids, block_ids, skip_tokens, cache_salt, request_id, key_extra)
        return self._finish_retrieve(self.session.call(msg, m.RetrieveResult))

    def retrieve_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
    ) -> Future[int]:
        """``retrieve`` without waiting: the future holds the valid prefix length."""
        reply = self.retrieve_reply_async(
            token_ids, block_ids, skip_tokens, cache_salt=cache_salt, request_id=request_id,
            key_extra=key_extra,
        )  # fmt: skip
        return then(reply, lambda r: r.retrieved_tokens)

    def retrieve_reply_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
        key_extra: str = "",
        awaited: tuple[int, int] = (0, 0),
    ) -> Future[m.RetrieveResult]:
        """``retrieve_async`` with the daemon's whole reply: the prefix length and what its
        copies moved (``num_bytes``, ``transfer_seconds``), for offload statistics.
        ``awaited``: (chunks, ms): the leading chunks another engine is storing, and how long
        the daemon may wait for them (``m.Retrieve.await_chunks``; a prefill/decode split)."""
        msg = self._retrieve_msg(
            token_ids, block_ids, skip_tokens, cache_salt, request_id, key_extra, awaited
        )
        return then(self.session.submit(msg, m.RetrieveResult), self._finish_retrieve)

    def _finish_retrieve(self, reply: m.RetrieveResult) -> m.RetrieveResult:
        if reply.cuda_event is not None and self._device.type == "cuda":
            # The engine's stream must not touch the blocks before the daemon's copy is done.
            wait_ipc_event(reply.cuda_event, self._device)
        return reply

    # -- pages by key (SGLang HiCache: kvcache.integrations.sglang) ------------------------

    def page_set(self, msg: m.PageSet) -> m.StoreResult:
        """Store pages under their keys; the reply counts stored and already-held pages."""
        return self.session.call(msg, m.StoreResult)

    def page_get(self, msg: m.PageGet) -> m.RetrieveResult:
        """Copy the leading run of held pages into the message's block ids."""
        return self.session.call(msg, m.RetrieveResult)

    def page_exists(self, msg: m.PageExists) -> m.PageExistsResult:
        """How many leading pages of the message's keys are held."""
        return self.session.call(msg, m.PageExistsResult)

    def report_block_allocations(
        self, records: Sequence[BlockAllocationRecord], *, wait: bool = True
    ) -> None:
        """Report a step's block allocations (L0 lifecycle metrics). ``wait=False`` queues it
        on the background thread and returns at once: a scheduler must never block on it."""
        msg = m.ReportBlockAllocations(instance_id=self.instance_id, records=list(records))
        if wait:
            self.session.call(msg, m.Done)
        else:
            self.session.notify(msg)

    def end_session(self, request_id: str, *, wait: bool = True) -> None:
        """Tell the daemon a request ended; ``wait=False`` as for ``report_block_allocations``."""
        msg = m.EndSession(instance_id=self.instance_id, request_id=request_id)
        if wait:
            self.session.call(msg, m.Done)
        else:
            self.session.notify(msg)

    # -- health ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self.session.call(m.Status(), m.StatusResult))

    def ping(self) -> bool:
        """True if the daemon answers and knows this instance; raises when it does not answer."""
        return self.session.call(m.Ping(instance_id=self.instance_id), m.Pong).registered

    def close(self, *, unregister: bool = True) -> None:
        """Unregister (best effort) and release the sockets; the tensors stay the caller's."""
        if self.session.closed:
            return
        self.session.close(unregister=unregister)
        self._kv_caches = None

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVCacheClient"]
