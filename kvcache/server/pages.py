"""The daemon's page requests (SGLang HiCache): ``PageExists``, ``PageSet``, ``PageGet``.

Kept apart from ``handlers`` so the SGLang surface can be read (and bounded) in one place; it
reuses the handlers' checks, so a page client is held to exactly what a chunk client is: the
registration token bound to the principal that registered, the tenant's salt rules, the
deadline, and the id bound (``--max-ids``, here also on the number of keys). Everything a
client sends is untrusted: keys are counted before they are hashed, block ids are range-checked
by the engine (and again by the native copy), and an instance registered for another principal
is refused before its keys are looked at.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from kvcache.errors import ChunkMismatchError, LimitExceededError
from kvcache.futures import then
from kvcache.protocol import messages as m
from kvcache.server.auth import Principal
from kvcache.server.deadlines import check_deadline, copy_deadline

if TYPE_CHECKING:
    import numpy as np

    from kvcache.engine.engine import CacheEngine
    from kvcache.engine.records import RetrieveResult, StoreResult
    from kvcache.server.registration import Limits
    from kvcache.server.registry import Instance


class Checks(Protocol):
    """What the page handlers take from ``handlers.Handlers`` (named here, not imported:
    ``handlers`` imports this module)."""

    engine: CacheEngine
    limits: Limits

    def _instance(self, req: Any, principal: Principal, *, token_required: bool) -> Instance: ...

    def _ids(self, ids: m.IdArray) -> np.ndarray: ...

    @staticmethod
    def _key_salt(req: Any, instance: Instance) -> str: ...


class PageHandlers:
    """The three page handlers, bound to the daemon's ``Handlers`` (their checks, engine and
    limits). Thread-safe as the handlers are; the set and get handlers only submit."""

    def __init__(self, handlers: Checks) -> None:
        self._h = handlers

    def table(self) -> dict[type, Callable[[Any, Principal], m.ReplyBody]]:
        return {
            m.PageExists: self.exists,
            m.PageSet: lambda req, p: self.set_async(req, p).result(),
            m.PageGet: lambda req, p: self.get_async(req, p).result(),
        }

    def async_table(self) -> dict[type, Callable[[Any, Principal], Future[m.ReplyBody]]]:
        return {m.PageSet: self.set_async, m.PageGet: self.get_async}

    def _checked(
        self, req: m.PageExists | m.PageSet | m.PageGet, principal: Principal
    ) -> tuple[Instance, str]:
        """The instance (token and tenant checked) and the salt its pages are keyed with."""
        token_required = not isinstance(req, m.PageExists)
        instance = self._h._instance(req, principal, token_required=token_required)
        if len(req.keys) % m.PAGE_KEY_BYTES:
            raise ChunkMismatchError(
                f"page keys are {m.PAGE_KEY_BYTES} bytes each; got {len(req.keys)} bytes"
            )
        count = len(req.keys) // m.PAGE_KEY_BYTES
        if count > self._h.limits.max_ids:
            raise LimitExceededError(
                f"{count} page keys in one request; the limit is {self._h.limits.max_ids} (--max-ids)"
            )
        salt = self._h._key_salt(_Salted(req.cache_salt), instance)
        return instance, salt

    def exists(self, req: m.PageExists, principal: Principal) -> m.ReplyBody:
        _, salt = self._checked(req, principal)
        hit, l2 = self._h.engine.pages.exists(req.instance_id, req.keys, cache_salt=salt)
        return m.PageExistsResult(hit_pages=hit, l2_pages=l2)

    def set_async(self, req: m.PageSet, principal: Principal) -> Future[m.ReplyBody]:
        _, salt = self._checked(req, principal)
        check_deadline(req.deadline_ms, "page set")
        stored = self._h.engine.pages.store_async(
            req.instance_id, req.keys, self._h._ids(req.block_ids), cache_salt=salt,
            copy_by=copy_deadline(req.deadline_ms),
        )  # fmt: skip
        return then(stored, _set_reply)

    def get_async(self, req: m.PageGet, principal: Principal) -> Future[m.ReplyBody]:
        _, salt = self._checked(req, principal)
        check_deadline(req.deadline_ms, "page get")
        got = self._h.engine.pages.retrieve_async(
            req.instance_id, req.keys, self._h._ids(req.block_ids), cache_salt=salt,
            copy_by=copy_deadline(req.deadline_ms),
        )  # fmt: skip
        return then(got, _get_reply)


class _Salted:
    """What ``Handlers._key_salt`` reads from a request: page requests carry no ``key_extra``
    (SGLang folds its extra key into the page hashes themselves)."""

    __slots__ = ("cache_salt", "key_extra")

    def __init__(self, cache_salt: str) -> None:
        self.cache_salt = cache_salt
        self.key_extra = ""


def _set_reply(result: StoreResult) -> m.ReplyBody:
    return m.StoreResult(
        stored_chunks=result.stored_chunks,
        skipped_chunks=result.skipped_chunks,
        failed_chunks=result.failed_chunks,
        stored_tokens=result.stored_tokens,
        num_bytes=result.num_bytes,
        transfer_seconds=result.transfer_seconds,
    )


def _get_reply(result: RetrieveResult) -> m.ReplyBody:
    return m.RetrieveResult(
        retrieved_tokens=result.retrieved_tokens,
        num_bytes=result.num_bytes,
        transfer_seconds=result.transfer_seconds,
    )


__all__ = ["PageHandlers"]
