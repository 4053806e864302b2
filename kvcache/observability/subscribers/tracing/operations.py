"""OpenTelemetry spans for store, retrieve and lookup, built from their START/END events.

Its own subscriber because tracing needs the optional OpenTelemetry packages and an OTLP
collector; ``kvcache.observability`` must import without them, so ``opentelemetry`` is
imported only when a ``TracingSubscriber`` is constructed.

A span starts at the START event's timestamp and ends at the END event's, so the span
shows when the work happened, not when the dispatcher got to it. Open spans are keyed by
(session_id, instance_id, device, operation): tensor-parallel workers share a request id,
and keying by the session alone would end one worker's span with another's event. Spans
still open at shutdown (an END that never came) are ended then, marked
``kvcache.leaked = true`` with an error status.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType, MpRetrieveEnd, MpStoreEnd, OperationMeta

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

_OPERATION = {
    EventType.MP_STORE_START: "store",
    EventType.MP_STORE_END: "store",
    EventType.MP_RETRIEVE_START: "retrieve",
    EventType.MP_RETRIEVE_END: "retrieve",
    EventType.MP_LOOKUP_START: "lookup",
    EventType.MP_LOOKUP_END: "lookup",
}
SPAN_NAMES = {op: f"kvcache.{op}" for op in ("store", "retrieve", "lookup")}
_MAX_OPEN_SPANS = 65_536
SpanKey = tuple[str, object, str, str]


def _ns(seconds: float | None) -> int:
    return int((time.time() if seconds is None else seconds) * 1e9)


def _attributes(event: Event) -> dict[str, Any]:
    """OTel attributes from event metadata: scalars only, prefixed ``kvcache.``."""
    attrs: dict[str, Any] = {"kvcache.session_id": event.session_id}
    for key, value in msgspec.structs.asdict(event.metadata).items():
        if isinstance(value, bool | int | float | str):
            attrs[f"kvcache.{key}"] = value
    return attrs


class TracingSubscriber(EventSubscriber):
    """Emits one span per store / retrieve / lookup through ``tracer_provider``."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from opentelemetry import trace

        provider = tracer_provider or trace.get_tracer_provider()
        self._tracer: Tracer = provider.get_tracer("kvcache.observability")
        self._open: dict[SpanKey, Span] = {}

    @property
    def open_spans(self) -> int:
        return len(self._open)

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {
            event_type: (self._on_end if event_type.value.endswith(".end") else self._on_start)
            for event_type in _OPERATION
        }

    @staticmethod
    def _key(event: Event) -> SpanKey:
        md = cast(OperationMeta, event.metadata)
        return (event.session_id, md.instance_id, md.device, _OPERATION[event.event_type])

    def _on_start(self, event: Event) -> None:
        key = self._key(event)
        stale = self._open.pop(key, None)
        if stale is not None:  # a START twice without END: close the first as leaked
            self._end_leaked(stale, event.timestamp)
        if len(self._open) >= _MAX_OPEN_SPANS:
            oldest = next(iter(self._open))
            self._end_leaked(self._open.pop(oldest), event.timestamp)
        self._open[key] = self._tracer.start_span(
            SPAN_NAMES[key[3]], start_time=_ns(event.timestamp), attributes=_attributes(event)
        )

    def _on_end(self, event: Event) -> None:
        from opentelemetry.trace import Status, StatusCode

        key = self._key(event)
        span = self._open.pop(key, None)
        if span is None:  # START never seen (dropped): a zero-length span still records it
            span = self._tracer.start_span(
                SPAN_NAMES[key[3]],
                start_time=_ns(event.timestamp),
                attributes={"kvcache.start_missing": True},
            )
        span.set_attributes(_attributes(event))
        md = event.metadata
        if isinstance(md, MpStoreEnd | MpRetrieveEnd) and not md.success:
            span.set_status(Status(StatusCode.ERROR, "operation reported failure"))
        span.end(end_time=_ns(event.timestamp))

    @staticmethod
    def _end_leaked(span: Span, at: float | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("kvcache.leaked", True)
        span.set_status(Status(StatusCode.ERROR, "no END event"))
        span.end(end_time=_ns(at))

    def shutdown(self) -> None:
        now = time.time()
        for span in self._open.values():
            self._end_leaked(span, now)
        self._open.clear()


__all__ = ["SPAN_NAMES", "TracingSubscriber"]
