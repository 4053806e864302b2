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
from kvcache.ids import RawIds, check_count, unpacked
from kvcache.keys import KeyScope
from kvcache.protocol import messages as m
from kvcache.server.auth import Principal
from kvcache.server.deadlines import accept_deadline

if TYPE_CHECKING:
    from kvcache.engine.engine import CacheEngine
    from kvcache.server.registration import Limits
    from kvcache.server.registry import RegistrationRecord


class Checks(Protocol):
    """What the page handlers take from ``handlers.Handlers`` (named here, not imported:
    ``handlers`` imports this module)."""

    engine: CacheEngine
    limits: Limits

    def _instance(self, req: Any, principal: Principal, *, token_required: bool) -> RegistrationRecord: ...


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

    def async_table(self) -> dict[type, Callable[[Any, Principal], Future[Any]]]:
        return {m.PageSet: self.set_async, m.PageGet: self.get_async}

    def _checked(
        self, req: m.PageExists | m.PageSet | m.PageGet, principal: Principal
    ) -> tuple[RegistrationRecord, str]:
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
        # page requests carry no ``key_extra``: SGLang folds its extra key into the page hashes
        salt = KeyScope(req.cache_salt, "", instance.door).salt_field()
        return instance, salt

    def _ids(self, raw: m.IdArray) -> RawIds:
        check_count(raw, self._h.limits.max_ids)
        return unpacked(raw)

    def exists(self, req: m.PageExists, principal: Principal) -> m.ReplyBody:
        _, salt = self._checked(req, principal)
        hit, l2 = self._h.engine.pages.exists(req.instance_id, req.keys, cache_salt=salt)
        return m.PageExistsResult(hit_pages=hit, l2_pages=l2)

    def set_async(self, req: m.PageSet, principal: Principal) -> Future[m.StoreResult]:
        """The engine's result is the reply (one record, engine and wire)."""
        _, salt = self._checked(req, principal)
        deadline = accept_deadline(req.deadline_ms, "page set")
        return self._h.engine.pages.store_async(
            req.instance_id, req.keys, self._ids(req.block_ids), cache_salt=salt,
            deadline=deadline,
        )  # fmt: skip

    def get_async(self, req: m.PageGet, principal: Principal) -> Future[m.RetrieveResult]:
        _, salt = self._checked(req, principal)
        deadline = accept_deadline(req.deadline_ms, "page get")
        return self._h.engine.pages.retrieve_async(
            req.instance_id, req.keys, self._ids(req.block_ids), cache_salt=salt,
            deadline=deadline,
        )  # fmt: skip


__all__ = ["PageHandlers"]
