"""OpenTelemetry tracer provider exporting spans over OTLP/HTTP (protobuf).

Separate so the optional ``opentelemetry-sdk`` and exporter packages are imported only when
tracing is switched on (``--enable-tracing``); ``kvcache.observability`` itself never
imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.errors import TracingUnavailableError  # re-exported: its home before kvcache.errors

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def build_tracer_provider(endpoint: str, service_name: str = "kvcache") -> TracerProvider:
    """A provider batching spans to ``endpoint`` (e.g. ``http://127.0.0.1:4318/v1/traces``).

    Call ``shutdown()`` on it to flush the last batch.
    """
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TracingUnavailableError(
            "tracing needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http "
            "(pip install 'kvcache[tracing]')"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


__all__ = ["TracingUnavailableError", "build_tracer_provider"]
