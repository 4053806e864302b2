"""Tracing end to end: real OTLP/HTTP exporter -> local receiver -> decoded protobuf spans."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from kvcache.observability.bus import EventBus  # noqa: E402
from kvcache.observability.event import EventType  # noqa: E402
from kvcache.observability.otel import build_tracer_provider  # noqa: E402
from kvcache.observability.subscribers.tracing import TracingSubscriber  # noqa: E402
from tests.helpers import event  # noqa: E402


class Receiver:
    """A minimal OTLP/HTTP traces endpoint that keeps every decoded span."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.paths.append(self.path)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out


def md(device: str = "cuda:0", **kw: object) -> dict[str, object]:
    return {"instance_id": 7, "model_name": "llama", "device": device, **kw}


def test_spans_reach_an_otlp_receiver(receiver: Receiver) -> None:
    provider = build_tracer_provider(receiver.url)
    bus = EventBus(registry=CollectorRegistry())
    tracing = TracingSubscriber(provider)
    bus.register_subscriber(tracing)
    bus.start()
    pub = bus.publish
    # Two tensor-parallel workers share request id "req-1"; their events interleave.
    pub(event(EventType.MP_STORE_START, md("cuda:0", num_tokens=512), "req-1", 1000.0))
    pub(event(EventType.MP_STORE_START, md("cuda:1", num_tokens=512), "req-1", 1000.1))
    pub(
        event(
            EventType.MP_STORE_END,
            md("cuda:1", num_tokens=512, stored_chunks=2, success=True),
            "req-1",
            1000.2,
        )
    )
    pub(
        event(
            EventType.MP_STORE_END,
            md("cuda:0", num_tokens=512, stored_chunks=2, success=False),
            "req-1",
            1000.25,
        )
    )
    pub(event(EventType.MP_LOOKUP_START, md(num_tokens=64), "req-2", 1001.0))
    pub(event(EventType.MP_LOOKUP_END, md(num_tokens=64, hit_tokens=32), "req-2", 1001.5))
    pub(event(EventType.MP_RETRIEVE_START, md(num_tokens=8), "req-3", 1002.0))  # never ends
    assert bus.flush(5)
    assert tracing.open_spans == 1
    bus.stop()  # ends the leaked span
    provider.shutdown()  # flushes the batch to the receiver

    assert set(receiver.paths) == {"/v1/traces"}
    by_key = {(s.name, attrs(s).get("kvcache.device")): s for s in receiver.spans}
    assert len(receiver.spans) == 4
    w0 = by_key[("kvcache.store", "cuda:0")]
    w1 = by_key[("kvcache.store", "cuda:1")]
    assert (w0.start_time_unix_nano, w0.end_time_unix_nano) == (1000_000_000_000, 1000_250_000_000)
    assert (w1.start_time_unix_nano, w1.end_time_unix_nano) == (1000_100_000_000, 1000_200_000_000)
    a0 = attrs(w0)
    assert a0["kvcache.session_id"] == "req-1"
    assert a0["kvcache.instance_id"] == 7 and a0["kvcache.model_name"] == "llama"
    assert a0["kvcache.num_tokens"] == 512 and a0["kvcache.stored_chunks"] == 2
    assert w0.status.code == 2  # STATUS_CODE_ERROR: the END reported failure
    assert w1.status.code != 2
    lookup = by_key[("kvcache.lookup", "cuda:0")]
    assert attrs(lookup)["kvcache.hit_tokens"] == 32
    assert lookup.end_time_unix_nano - lookup.start_time_unix_nano == 500_000_000
    leaked = by_key[("kvcache.retrieve", "cuda:0")]
    assert attrs(leaked)["kvcache.leaked"] is True
    assert leaked.start_time_unix_nano == 1002_000_000_000


def test_end_without_start_still_produces_a_span(receiver: Receiver) -> None:
    provider = build_tracer_provider(receiver.url)
    sub = TracingSubscriber(provider)
    on_end = sub.subscriptions()[EventType.MP_STORE_END]
    on_end(event(EventType.MP_STORE_END, md(), "lonely", 5.0))
    sub.shutdown()
    provider.shutdown()
    (span,) = receiver.spans
    assert span.name == "kvcache.store"
    assert attrs(span)["kvcache.start_missing"] is True
