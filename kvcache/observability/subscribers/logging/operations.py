"""Human-readable log lines for every event, through the standard ``logging`` module.

Its own subscriber so logs can be switched off (``--disable-logging``) while metrics stay.
One concise INFO line per finished store, retrieve and lookup; failures at WARNING;
everything else (starts, L1/L2 traffic, block allocations) at DEBUG with its metadata.
Formatting is skipped entirely when the level is disabled, so the cost of a quiet logger
is one ``isEnabledFor`` call per event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import cast

import msgspec

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import (
    Event,
    EventType,
    InstanceMeta,
    L1AllocationFailed,
    L2LoadFailed,
    L2StoreFailed,
    MpLookupEnd,
    MpRetrieveEnd,
    MpStoreEnd,
)

_WARN_TYPES = frozenset({EventType.L1_ALLOCATION_FAILED, EventType.L2_STORE_FAILED, EventType.L2_LOAD_FAILED})


class LoggingSubscriber(EventSubscriber):
    """Logs events to ``logger`` (default ``kvcache.events``)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("kvcache.events")

    def subscriptions(self) -> Mapping[EventType, Callback]:
        routes: dict[EventType, Callback] = dict.fromkeys(EventType, self._on_detail)
        routes[EventType.MP_STORE_END] = self._on_store_end
        routes[EventType.MP_RETRIEVE_END] = self._on_retrieve_end
        routes[EventType.MP_LOOKUP_END] = self._on_lookup_end
        for event_type in _WARN_TYPES:
            routes[event_type] = self._on_failure
        return routes

    @staticmethod
    def _who(event: Event, md: InstanceMeta) -> str:
        return f"session={event.session_id or '-'} instance={md.instance_id} model={md.model_name or '-'}"

    @staticmethod
    def _rate(md: MpStoreEnd | MpRetrieveEnd) -> str:
        nbytes, seconds = md.num_bytes, md.transfer_seconds
        if seconds > 0:
            return f"{nbytes} B in {seconds * 1e3:.3f} ms ({nbytes / seconds / 1e9:.2f} GB/s)"
        return f"{nbytes} B"

    @staticmethod
    def _level(md: MpStoreEnd | MpRetrieveEnd) -> int:
        return logging.INFO if md.success else logging.WARNING

    def _on_store_end(self, event: Event) -> None:
        md = cast(MpStoreEnd, event.metadata)
        level = self._level(md)
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "store %s device=%s tokens=%s stored_chunks=%s skipped=%s failed=%s %s%s",
                self._who(event, md),
                md.device,
                md.num_tokens,
                md.stored_chunks,
                md.skipped_chunks,
                md.failed_chunks,
                self._rate(md),
                "" if md.success else " FAILED",
            )

    def _on_retrieve_end(self, event: Event) -> None:
        md = cast(MpRetrieveEnd, event.metadata)
        level = self._level(md)
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "retrieve %s device=%s requested=%s retrieved=%s (skip=%s l1=%s l2=%s missing=%s) %s%s",
                self._who(event, md),
                md.device,
                md.num_tokens,
                md.retrieved_tokens,
                md.skip_tokens,
                md.l1_tokens,
                md.l2_tokens,
                md.missing_tokens,
                self._rate(md),
                "" if md.success else " FAILED",
            )

    def _on_lookup_end(self, event: Event) -> None:
        md = cast(MpLookupEnd, event.metadata)
        if self.logger.isEnabledFor(logging.INFO):
            self.logger.info(
                "lookup %s tokens=%s hit=%s (l1=%s l2=%s)",
                self._who(event, md),
                md.num_tokens,
                md.hit_tokens,
                md.l1_hit_tokens,
                md.l2_hit_tokens,
            )

    def _on_failure(self, event: Event) -> None:
        if self.logger.isEnabledFor(logging.WARNING):
            md = cast(L1AllocationFailed | L2StoreFailed | L2LoadFailed, event.metadata)
            fields = msgspec.structs.asdict(md)
            keys = fields.pop("keys", ())
            self.logger.warning("%s %s keys=%d", event.event_type.value, fields, len(keys))

    def _on_detail(self, event: Event) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "%s session=%s %s",
                event.event_type.value,
                event.session_id or "-",
                msgspec.structs.asdict(event.metadata),
            )


__all__ = ["LoggingSubscriber"]
