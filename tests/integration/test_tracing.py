"""One request's trace through ingress, admission and a worker on the real broker and
Redis: a span for every stage, each under the right parent across the HTTP hop and the
two Kafka hops (``services.common.tracing``)."""

from __future__ import annotations

import json

import httpx
import pytest

from schemas import Tier
from seawall_client import tracecontext
from services.common import tracing
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.admission_helpers import admission_settings, started
from tests.fleet import sim_worker, until, worker_settings
from tests.integration.ingress.conftest import ingress_settings, new_key, stream_chat

pytestmark = pytest.mark.integration

INGRESS = ("ingress.receive", "ingress.authenticate", "ingress.screen", "ingress.publish")
ADMISSION = ("admission.read", "admission.charge", "admission.schedule", "admission.dispatch")
WORKER = (
    "worker.read",
    "worker.claim",
    "worker.first_token",
    "worker.publish_first_chunk",
    "worker.generate",
)
DELIVERY = ("ingress.first_chunk", "ingress.reply")


async def test_a_streamed_request_has_every_stage_under_its_parent(
    settings: CommonSettings, trace_sink: tracing.MemorySink
) -> None:
    from services.admission.service import Admission

    ingress = IngressService(ingress_settings(settings))
    admission = Admission(admission_settings(settings))
    worker = sim_worker(worker_settings(settings))
    client_span = tracecontext.new_trace()
    async with started(ingress, admission, worker):
        key = await new_key(ingress.keystore, "traced-co", Tier.PRO)
        headers = {"Authorization": f"Bearer {key}", tracecontext.HEADER: client_span.header}
        answer = await stream_chat(ingress.port, headers, max_tokens=24)
        assert answer.status == 200
        events = answer.events
        request_id = answer.headers["x-request-id"]
        assert events[-1] == "data: [DONE]"
        assert any(json.loads(e[6:]).get("choices") for e in events[:-1])

        def complete() -> bool:
            tracing.flush()
            names = {s.name for s in trace_sink.spans if s.trace_id == client_span.trace_id}
            return {tracing.ROOT, *INGRESS, *ADMISSION, *WORKER, *DELIVERY} <= names

        await until(complete, timeout_s=10)

    spans = [s for s in trace_sink.spans if s.trace_id == client_span.trace_id]
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), "each stage once"
    root = by_name[tracing.ROOT]
    assert root.parent_id == client_span.span_id  # the client's traceparent is the parent
    assert root.service == "ingress"
    assert root.attributes["request_id"] == request_id

    def parent_of(name: str) -> str | None:
        return by_name[name].parent_id

    for name in (*INGRESS, *DELIVERY):
        assert parent_of(name) == root.span_id, name
    # Across the Kafka hops: admission's stages under the record ingress published,
    # the worker's under the dispatch record admission produced.
    for name in ADMISSION:
        assert parent_of(name) == by_name["ingress.publish"].span_id, name
    for name in WORKER:
        assert parent_of(name) == by_name["admission.dispatch"].span_id, name
    assert {by_name[n].service for n in ADMISSION} == {"admission"}
    assert {by_name[n].service for n in WORKER} == {"worker"}

    # Each span starts within the request's, and the stages come in the order they happen.
    # Every stage of ingress and admission also ends within it; the worker's may not: it
    # learns that its terminal reply was written only from the broker's acknowledgement,
    # which can reach it after ingress has already read the reply and closed the request.
    assert all(root.start_ns <= s.start_ns <= root.end_ns for s in spans)
    assert all(s.end_ns <= root.end_ns for s in spans if s.service != "worker")
    order = ["ingress.publish", "admission.charge", "admission.dispatch", "worker.claim"]
    starts = [by_name[n].start_ns for n in order]
    assert starts == sorted(starts)
    assert by_name["worker.first_token"].end_ns <= by_name["ingress.first_chunk"].end_ns
    assert by_name["ingress.first_chunk"].end_ns <= by_name["ingress.reply"].end_ns


async def test_nothing_is_recorded_or_sent_without_a_sink(settings: CommonSettings) -> None:
    tracing.use([])
    tracer = tracing.Tracer("ingress")
    span = tracer.begin(tracing.ROOT, None)
    assert span.context is None
    assert not span.recording
    # A client's context passes through untouched, for the next hop's header.
    parent = tracecontext.new_trace()
    child = tracer.start("ingress.publish", parent)
    assert child.context == parent
    assert not child.recording


async def test_a_refusal_at_the_gate_leaves_no_spans_and_a_later_one_does(
    settings: CommonSettings, trace_sink: tracing.MemorySink
) -> None:
    """A flood of bad keys or oversized bodies must not write a trace per refusal; a
    request refused once its tenant is known (here: a malformed body) keeps its trace,
    with the stages it went through."""
    ingress = IngressService(ingress_settings(settings))
    async with started(ingress):
        key = await new_key(ingress.keystore, "traced-co", Tier.PRO)
        good = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{ingress.port}", timeout=30
        ) as http:
            gate = [
                await http.post(
                    "/v1/chat/completions",
                    json=good,
                    headers={"Authorization": "Bearer sk-sw-000000000000_" + "x" * 43},
                ),
                await http.post(
                    "/v1/chat/completions",
                    content=b"x" * (ingress.settings.max_request_bytes + 1),
                    headers={"Authorization": f"Bearer {key}"},
                ),
            ]
            screened = await http.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
    assert [r.status_code for r in gate] == [401, 413]
    assert screened.status_code == 400
    tracing.flush()
    roots = {s.attributes.get("request_id"): s for s in trace_sink.spans if s.name == tracing.ROOT}
    for response in gate:
        assert response.headers["x-request-id"] not in roots
    root = roots[screened.headers["x-request-id"]]
    assert root.attributes["refused"]
    children = {s.name for s in trace_sink.spans if s.parent_id == root.span_id}
    assert children == {"ingress.receive", "ingress.authenticate", "ingress.screen"}
