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

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType

_WARN_TYPES = frozenset(
    {EventType.L1_ALLOCATION_FAILED, EventType.L2_STORE_FAILED, EventType.L2_LOAD_FAILED}
)


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
    def _who(event: Event) -> str:
        md = event.metadata
        return (f"session={event.session_id or '-'} instance={md.get('instance_id', '-')} "
                f"model={md.get('model_name', '') or '-'}")

    @staticmethod
    def _rate(md: Mapping[str, object]) -> str:
        nbytes, seconds = md.get("num_bytes", 0), md.get("transfer_seconds", 0.0)
        assert isinstance(nbytes, int | float) and isinstance(seconds, int | float)
        if seconds > 0:
            return f"{nbytes} B in {seconds * 1e3:.3f} ms ({nbytes / seconds / 1e9:.2f} GB/s)"
        return f"{nbytes} B"

    def _level(self, md: Mapping[str, object]) -> int:
        return logging.INFO if md.get("success", True) else logging.WARNING

    def _on_store_end(self, event: Event) -> None:
        md = event.metadata
        level = self._level(md)
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "store %s device=%s tokens=%s stored_chunks=%s skipped=%s failed=%s %s%s",
                self._who(event), md.get("device", "-"), md.get("num_tokens"),
                md.get("stored_chunks"), md.get("skipped_chunks"), md.get("failed_chunks"),
                self._rate(md), "" if md.get("success", True) else " FAILED",
            )

    def _on_retrieve_end(self, event: Event) -> None:
        md = event.metadata
        level = self._level(md)
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "retrieve %s device=%s requested=%s retrieved=%s (skip=%s l1=%s l2=%s "
                "missing=%s) %s%s",
                self._who(event), md.get("device", "-"), md.get("num_tokens"),
                md.get("retrieved_tokens"), md.get("skip_tokens"), md.get("l1_tokens"),
                md.get("l2_tokens"), md.get("missing_tokens"), self._rate(md),
                "" if md.get("success", True) else " FAILED",
            )

    def _on_lookup_end(self, event: Event) -> None:
        md = event.metadata
        if self.logger.isEnabledFor(logging.INFO):
            self.logger.info(
                "lookup %s tokens=%s hit=%s (l1=%s l2=%s)",
                self._who(event), md.get("num_tokens"), md.get("hit_tokens"),
                md.get("l1_hit_tokens"), md.get("l2_hit_tokens"),
            )

    def _on_failure(self, event: Event) -> None:
        if self.logger.isEnabledFor(logging.WARNING):
            md = {k: v for k, v in event.metadata.items() if k != "keys"}
            nkeys = len(event.metadata.get("keys", ()))
            self.logger.warning("%s %s keys=%d", event.event_type.value, md, nkeys)

    def _on_detail(self, event: Event) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "%s session=%s %s", event.event_type.value, event.session_id or "-",
                event.metadata,
            )


__all__ = ["LoggingSubscriber"]
