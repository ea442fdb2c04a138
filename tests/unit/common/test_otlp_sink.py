"""The OTLP sink speaks OTLP/HTTP: a real receiver (a local HTTP server decoding the
protobuf with opentelemetry-proto) gets the spans with their trace, parents and times."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from services.common import tracing

pytestmark = pytest.mark.unit


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ExportTraceServiceRequest]]:
    got: list[ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            got.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        yield got
    finally:
        server.shutdown()


def test_spans_reach_an_otlp_receiver(receiver: list[ExportTraceServiceRequest]) -> None:
    tracing.configure("admission", trace_dir=None, file_mb=1, sample=1.0)
    try:
        tracer = tracing.Tracer("admission")
        root = tracer.begin(tracing.ROOT, None, 1_000, request_id="r1")
        tracer.record("admission.charge", root.context, 2_000, 3_000)
        root.end(4_000)
        tracing.flush()
    finally:
        tracing.use([])
    assert root.context is not None
    (request,) = receiver
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "seawall-admission"
    spans = {s.name: s for scope in resource_spans.scope_spans for s in scope.spans}
    charge, top = spans["admission.charge"], spans[tracing.ROOT]
    assert charge.trace_id.hex() == top.trace_id.hex() == root.context.trace_id
    assert charge.parent_span_id == top.span_id
    assert (charge.start_time_unix_nano, charge.end_time_unix_nano) == (2_000, 3_000)
    assert {a.key: a.value.string_value for a in top.attributes} == {"request_id": "r1"}
