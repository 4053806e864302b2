"""The tier's link to the daemon: one registered staging buffer, and the three page calls.

Kept apart from the tier (``manager``) so it imports no vLLM: it is plain bytes in, bytes out,
testable against a daemon on its own. Every method here may block (a daemon round trip, a
copy); the tier calls them only from its own threads (``jobs``, the lookup thread), never from
vLLM's scheduler.

Each vLLM offload chunk is one page at the daemon (``server/pages.py``, the door SGLang uses):
the staging buffer is registered as ``NL_X_NB_BS_HS`` with one layer, one token per block and a
width of one primary row in bytes, so a page is a row's bytes, copied as they are. The daemon
keys a page by the instance's model name (the tier's scope, ``scope.py``), the geometry and
dtype (so rows of another size never match) and the tenant's ``cache_salt``; vLLM's own key
(block hash and group) is hashed to the 32 bytes a page key takes.

Why staged: vLLM's primary region is a ``/dev/shm`` file (``SharedOffloadRegion``) that cannot
be sealed, and the daemon maps only sealed memfds (a client could truncate anything else under
the daemon's mapping). So rows are copied once on this side, between the primary view and a
sealed-memfd staging buffer that the daemon maps; the daemon's own copy is the other one.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from kvcache.client import KVCacheClient
from kvcache.errors import DaemonUnavailableError, TransferError
from kvcache.integrations.vllm.tier.config import TierConfig
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.transport.memfd import empty_shared

log = logging.getLogger("kvcache.integrations.vllm.tier")

R = TypeVar("R")
FMT = "NL_X_NB_BS_HS"
_KEY_TAG = b"vllm-offload-key:"
LOOKUP_KEYS = 4096
"""Keys one ``PageExists`` carries at most (a daemon may bound them lower than its ids)."""
RETRY_REGISTER_S = 2.0
"""How long after a failed registration (no daemon) the next use tries again."""


def _settled(future: Future[R], timeout: float | None = None) -> R:
    """The future's result; its error raised as a new one. The future keeps its own error,
    whose traceback would otherwise hold the caller's frames, and so the primary rows they
    reference, alive: vLLM cannot close its region while a view of it is out."""
    try:
        return future.result(timeout)
    except BaseException as err:
        err.__traceback__ = None
        kind = DaemonUnavailableError if isinstance(err, TimeoutError) else TransferError
        raise kind(f"{type(err).__name__}: {err}") from None


def page_keys(keys: Sequence[bytes]) -> bytes:
    """vLLM offload keys (block hash + group index, any length) as 32-byte page keys."""
    sha = hashlib.sha256
    return b"".join(sha(_KEY_TAG + bytes(k)).digest() for k in keys)


class DaemonLink:
    """One tier's client, staging buffer and registration. Thread-safe: the store thread uses
    the outgoing half of the staging buffer, the load thread the incoming half, lookups none;
    the daemon calls go through the client's background pipeline (one socket for all)."""

    def __init__(self, config: TierConfig, row_bytes: int, model_name: str) -> None:
        self.config = config
        self.row_bytes = row_bytes
        self.model_name = model_name
        self.staging_chunks = config.staging_chunks
        self._lock = threading.Lock()
        self._client: KVCacheClient | None = None
        self._failed_at: float | None = None
        self._connecting = False
        self._closed = False
        self.connected = threading.Event()
        """Set once registered (tests and operators wait on it; the tier never does)."""
        stage = empty_shared((2 * config.staging_chunks, 1, row_bytes), torch.uint8)
        self._stage_tensor = stage
        self.stage = stage.numpy().reshape(2 * config.staging_chunks, row_bytes).view(np.int8)

    # -- registration ----------------------------------------------------------------------
    def connect(self) -> None:
        """Start registering in the background, unless registered, registering, or a failed
        try was under ``RETRY_REGISTER_S`` ago. Never blocks: no caller waits on a daemon."""
        with self._lock:
            if self._client is not None or self._closed or self._connecting:
                return
            if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_REGISTER_S:
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="kvcache-tier-register", daemon=True).start()

    def _connect(self) -> None:
        client: KVCacheClient | None = None
        try:
            client = self._register()
        except Exception as err:
            if self._failed_at is None:
                log.warning("kvcache tier: no daemon at %s (%s); vLLM's CPU tier goes on alone",
                            self.config.endpoint or "the default endpoint", err)  # fmt: skip
        with self._lock:
            self._connecting = False
            if client is None:
                self._failed_at = time.monotonic()
            elif self._closed:
                client.close()
            else:
                self._client, self._failed_at = client, None
                self.connected.set()

    def client(self) -> KVCacheClient:
        """The registered client. Without one: starts registering (``connect``) and raises
        ``DaemonUnavailableError`` (the call fails, as any call to a dead daemon does)."""
        client = self._client
        if client is not None:
            return client
        self.connect()
        raise DaemonUnavailableError("the kvcache tier is not registered with a daemon (yet)")

    def _register(self) -> KVCacheClient:
        cfg = self.config
        client = KVCacheClient(
            cfg.endpoint, model_name=self.model_name, timeout_s=cfg.timeout_s, daemon_uid=cfg.daemon_uid,
            curve_server_key=cfg.curve_server_key, curve_secret_key=cfg.curve_secret_key,
        )  # fmt: skip
        try:
            client.register_kv_caches(
                [self._stage_tensor], engine="vllm", block_size=1, fmt=FMT, chunk_size=1
            )
        except BaseException:
            client.close(unregister=False)
            raise
        log.info("kvcache tier: registered as %s (%d-byte chunks, staged by %d)", self.model_name,
                 self.row_bytes, self.staging_chunks)  # fmt: skip
        return client

    # -- the page calls (blocking; the tier's threads only) -------------------------------
    def _batch(self, keys: Sequence[bytes], chunk_ids: Sequence[int]) -> int:
        """The batch's size, refused past one staging half (the job threads batch by it)."""
        if len(keys) != len(chunk_ids) or len(keys) > self.staging_chunks:
            raise ValueError(f"{len(keys)} keys and {len(chunk_ids)} chunk ids: one each, at most "
                             f"{self.staging_chunks} (staging_chunks) per batch")  # fmt: skip
        return len(keys)

    def _deadline_ms(self) -> int:
        return int((time.time() + self.config.timeout_s) * 1000)

    def leading_held(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the daemon holds (``PageExists``, ``LOOKUP_KEYS`` keys a
        round trip, each within ``lookup_timeout_s``, or raises)."""
        client = self.client()
        held = 0
        for lo in range(0, len(keys), LOOKUP_KEYS):
            part = keys[lo : lo + LOOKUP_KEYS]
            msg = m.PageExists(instance_id=client.instance_id, keys=page_keys(part),
                               cache_salt=self.config.cache_salt)  # fmt: skip
            future = client.session.submit(msg, m.PageExistsResult)
            run = int(_settled(future, self.config.lookup_timeout_s).hit_pages)
            held += run
            if run < len(part):
                break
        return held

    def store(self, primary: np.ndarray, chunk_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """Rows ``chunk_ids`` of ``primary`` stored under ``keys`` (at most ``staging_chunks``);
        how many the daemon now holds (stored, or present already)."""
        n = self._batch(keys, chunk_ids)
        client = self.client()
        out = self.stage[:n]
        np.take(primary, np.asarray(chunk_ids, dtype=np.int64), axis=0, out=out)
        msg = m.PageSet(instance_id=client.instance_id, keys=page_keys(keys), block_ids=pack_ids(range(n)),
                        cache_salt=self.config.cache_salt, deadline_ms=self._deadline_ms())  # fmt: skip
        reply = _settled(client.session.submit(msg, m.StoreResult))
        return int(reply.stored_chunks + reply.skipped_chunks)

    def load(self, primary: np.ndarray, chunk_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """The leading cached chunks of ``keys`` copied into rows ``chunk_ids`` of ``primary``;
        how many. Rows past that count are untouched. Waits for the daemon's answer (bounded by
        the call's deadline, after which the daemon moves no byte into the staging half)."""
        n = self._batch(keys, chunk_ids)
        client = self.client()
        base = self.staging_chunks
        msg = m.PageGet(instance_id=client.instance_id, keys=page_keys(keys),
                        block_ids=pack_ids(range(base, base + n)), cache_salt=self.config.cache_salt,
                        deadline_ms=self._deadline_ms())  # fmt: skip
        got = min(n, int(_settled(client.session.submit(msg, m.RetrieveResult)).retrieved_tokens))
        if got:
            primary[np.asarray(chunk_ids[:got], dtype=np.int64)] = self.stage[base : base + got]
        return got

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


__all__ = ["FMT", "DaemonLink", "page_keys"]
