"""What a serving engine imports to use the kvcache daemon: ``KVCacheClient``.

One client serves one engine instance. Calls mirror ``CacheEngine`` (same arguments, same
exceptions), so an engine can switch between the in-process engine and the daemon.

Two DEALER sockets, so that neither kind of call waits for the other:

* synchronous calls use the caller's socket under a lock: send, then wait for the reply with
  the same id (stale replies of timed-out calls are dropped). On a timeout the socket is
  thrown away and recreated, so a lost reply never wedges the client (a REQ socket would);
* ``store_async``/``retrieve_async`` and heartbeats go through a background thread with its
  own socket; it resolves ``concurrent.futures.Future`` objects and, if a restarted daemon has
  forgotten this instance, registers it again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec
import torch
import zmq

from kvcache.errors import UnknownInstanceError
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel
from kvcache.protocol.codec import pack_ids
from kvcache.protocol.errors import DaemonUnavailableError, exception_from_error
from kvcache.server.ipc import (
    empty_shared,
    export_tensor,
    flatten_kv_caches,
    record_ipc_event,
    to_shared,
)

log = logging.getLogger("kvcache.client")

R = TypeVar("R", bound=m.Reply)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


def _unwrap(reply: m.Reply, expected: type[R]) -> R:
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, m.Error):
        raise exception_from_error(reply)
    raise DaemonUnavailableError(f"unexpected reply {type(reply).__name__}")


class KVCacheClient:
    """The engine-side handle on the daemon for one engine instance.

    Thread-safe: synchronous calls from several threads are serialised on one socket;
    ``*_async`` calls run on the background thread. ``timeout_s`` bounds every call.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        instance_id: int = 0,
        model_name: str = "model",
        *,
        timeout_s: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self.instance_id = instance_id
        self.model_name = model_name
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._lock = threading.Lock()
        self._chan = Channel(self._ctx, endpoint)
        self._register_msg: m.Register | None = None
        self._kv_caches: Any = None
        self._registered: m.Registered | None = None
        self._device = torch.device("cpu")
        self._jobs: queue.SimpleQueue[tuple[m.RequestBody, Future[Any]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, body: m.RequestBody, expected: type[R]) -> R:
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        with self._lock:
            reply = self._call_on(self._chan, body)
        return _unwrap(reply, expected)

    def _call_on(self, chan: Channel, body: m.RequestBody) -> m.ReplyBody:
        """One call; if a restarted daemon has forgotten this instance, register again and
        retry once (the tensors are still shared, so nothing is lost but the daemon's L1)."""
        reply = chan.call(body, self.timeout_s)
        register = self._register_msg
        if (
            isinstance(reply, m.Error)
            and reply.code is m.ErrorCode.UNKNOWN_INSTANCE
            and register is not None
            and not isinstance(body, (m.Register, m.Unregister))
        ):
            _unwrap(chan.call(register, self.timeout_s), m.Registered)
            log.info("re-registered instance %d after a daemon restart", self.instance_id)
            reply = chan.call(body, self.timeout_s)
        return reply

    def _submit(self, body: m.RequestBody) -> Future[Any]:
        if self._closed:
            raise RuntimeError("KVCacheClient is closed")
        self._ensure_worker()
        future: Future[Any] = Future()
        self._jobs.put((body, future))
        return future

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._background, name=f"kvcache-client-{self.instance_id}", daemon=True
                )
                self._worker.start()

    def _background(self) -> None:
        """Runs queued async calls; sends a heartbeat ping whenever it has been idle."""
        chan = Channel(self._ctx, self.endpoint)
        try:
            while True:
                interval = self._heartbeat_interval()
                try:
                    job = self._jobs.get(timeout=interval)
                except queue.Empty:
                    self._heartbeat(chan)
                    continue
                if job is None:
                    return
                body, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(self._call_on(chan, body))
                except BaseException as exc:
                    future.set_exception(exc)
        finally:
            chan.close()

    def _heartbeat_interval(self) -> float:
        reg = self._registered
        return max(reg.heartbeat_timeout_s / 3, 0.05) if reg is not None else 1.0

    def _heartbeat(self, chan: Channel) -> None:
        if self._register_msg is None:
            return
        reg = self._registered
        # A beat waits no longer than the daemon's patience, so a restart is noticed quickly.
        wait = min(self.timeout_s, reg.heartbeat_timeout_s) if reg is not None else self.timeout_s
        try:
            pong = chan.call(m.Ping(instance_id=self.instance_id), wait)
        except DaemonUnavailableError as exc:  # the next beat retries; sync calls report it
            log.debug("heartbeat failed: %s", exc)
            return
        if isinstance(pong, m.Pong) and not pong.registered:
            try:
                _unwrap(chan.call(self._register_msg, self.timeout_s), m.Registered)
                log.info("re-registered instance %d with the daemon", self.instance_id)
            except Exception as exc:
                log.warning("re-registering instance %d failed: %s", self.instance_id, exc)

    # -- registration ------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: Any,
        engine: str = "vllm",
        block_size: int | None = None,
        fmt: Any = None,
    ) -> m.Registered:
        """Share the engine's KV tensors with the daemon (CPU: /dev/shm, GPU: CUDA IPC).

        ``kv_caches`` is one tensor, a list, or ``[K_list, V_list]``; CPU tensors must come
        from ``empty_shared``. ``fmt`` is a ``GPUKVFormat`` (or its name) when detection
        from shapes is ambiguous.
        """
        leaves, nesting, groups = flatten_kv_caches(kv_caches)
        fmt_name = fmt if isinstance(fmt, str) or fmt is None else fmt.name
        msg = m.Register(
            instance_id=self.instance_id,
            model_name=self.model_name,
            tensors=[export_tensor(t) for t in leaves],
            nesting=nesting,
            group_sizes=groups,
            engine=engine,
            fmt=fmt_name,
            block_size=block_size,
        )
        reply = self._call(msg, m.Registered)
        self._register_msg, self._registered, self._device = msg, reply, leaves[0].device
        # Keep the tensors (and so their /dev/shm files) alive for re-registration after a
        # daemon restart, even if the caller drops its own references.
        self._kv_caches = kv_caches
        self._ensure_worker()
        return reply

    def unregister(self) -> None:
        msg, self._register_msg = self._register_msg, None
        if msg is not None:
            self._call(m.Unregister(instance_id=self.instance_id), m.Done)

    # -- data path ---------------------------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], *, cache_salt: str = "", request_id: str = ""
    ) -> int:
        """Leading tokens of ``token_ids`` the cache holds (whole chunks)."""
        msg = m.Lookup(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            cache_salt=cache_salt,
            request_id=request_id,
        )
        return self._call(msg, m.LookupResult).hit_tokens

    def _store_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        cache_salt: str,
        request_id: str,
        block_hashes: Sequence[int] | None,
    ) -> m.Store:
        event = record_ipc_event(self._device) if self._device.type == "cuda" else None
        return m.Store(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            block_ids=pack_ids(block_ids),
            cache_salt=cache_salt,
            request_id=request_id,
            block_hashes=None if block_hashes is None else list(block_hashes),
            cuda_event=event,
        )

    def store(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
    ) -> m.StoreResult:
        """Copy the engine blocks ``block_ids`` (holding ``token_ids`` in order) into the cache."""
        msg = self._store_msg(token_ids, block_ids, cache_salt, request_id, block_hashes)
        return self._call(msg, m.StoreResult)

    def store_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        block_hashes: Sequence[int] | None = None,
    ) -> Future[m.StoreResult]:
        msg = self._store_msg(token_ids, block_ids, cache_salt, request_id, block_hashes)
        return self._chain(self._submit(msg), m.StoreResult)

    def _retrieve_msg(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int,
        cache_salt: str,
        request_id: str,
    ) -> m.Retrieve:
        return m.Retrieve(
            instance_id=self.instance_id,
            token_ids=pack_ids(token_ids),
            block_ids=pack_ids(block_ids),
            skip_tokens=skip_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
        )

    def retrieve(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
    ) -> int:
        """Copy cached chunks into ``block_ids``; returns the valid prefix length in tokens."""
        msg = self._retrieve_msg(token_ids, block_ids, skip_tokens, cache_salt, request_id)
        return self._finish_retrieve(self._call(msg, m.RetrieveResult))

    def retrieve_async(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        *,
        cache_salt: str = "",
        request_id: str = "",
    ) -> Future[int]:
        msg = self._retrieve_msg(token_ids, block_ids, skip_tokens, cache_salt, request_id)
        out: Future[int] = Future()
        inner = self._chain(self._submit(msg), m.RetrieveResult)

        def done(f: Future[m.RetrieveResult]) -> None:
            try:
                out.set_result(self._finish_retrieve(f.result()))
            except BaseException as exc:
                out.set_exception(exc)

        inner.add_done_callback(done)
        return out

    def _finish_retrieve(self, reply: m.RetrieveResult) -> int:
        if reply.cuda_event is not None and self._device.type == "cuda":
            # The engine's stream must not touch the blocks before the daemon's copy is done.
            from kvcache.server.ipc import wait_ipc_event

            wait_ipc_event(reply.cuda_event, self._device)
        return reply.retrieved_tokens

    @staticmethod
    def _chain(raw: Future[Any], expected: type[R]) -> Future[R]:
        out: Future[R] = Future()

        def done(f: Future[Any]) -> None:
            try:
                out.set_result(_unwrap(f.result(), expected))
            except BaseException as exc:
                out.set_exception(exc)

        raw.add_done_callback(done)
        return out

    def report_block_allocations(self, records: Sequence[BlockAllocationRecord]) -> None:
        msg = m.ReportBlockAllocations(instance_id=self.instance_id, records=list(records))
        self._call(msg, m.Done)

    def end_session(self, request_id: str) -> None:
        self._call(m.EndSession(instance_id=self.instance_id, request_id=request_id), m.Done)

    # -- health ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self._call(m.Status(), m.StatusResult))

    def ping(self) -> bool:
        """True if the daemon answers and knows this instance; raises when it does not answer."""
        return self._call(m.Ping(instance_id=self.instance_id), m.Pong).registered

    def close(self, *, unregister: bool = True) -> None:
        """Unregister (best effort) and release the sockets; the tensors stay the caller's."""
        if self._closed:
            return
        if unregister and self._register_msg is not None:
            try:
                self.unregister()
            except (DaemonUnavailableError, UnknownInstanceError) as exc:
                log.debug("unregister on close failed: %s", exc)
        self._closed = True
        self._register_msg = self._kv_caches = None
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=self.timeout_s + 1)
        with self._lock:
            self._chan.close()
        if self._worker is not None and self._worker.is_alive():
            self._ctx.destroy(linger=0)  # term() would wait for the stuck thread's socket
        else:
            self._ctx.term()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_ENDPOINT", "KVCacheClient", "empty_shared", "to_shared"]
