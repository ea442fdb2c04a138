"""Spans: recorded only where sampled and a sink listens, once each; the file sink's
bound; the stage breakdown ``seawall load`` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seawall.traces import stage_quantiles, traces_in, traces_of, waterfall
from seawall_client import tracecontext
from services.common import tracing

pytestmark = pytest.mark.unit


def test_spans_of_a_sampled_trace_are_recorded_once_under_their_parent(
    trace_sink: tracing.MemorySink,
) -> None:
    tracer = tracing.Tracer("ingress")
    root = tracer.begin(tracing.ROOT, None, 1_000, request_id="r1")
    assert root.recording
    assert root.context is not None
    child = tracer.start("ingress.publish", root.context, 2_000)
    child.end(3_000)
    child.end(4_000)  # a second end records nothing
    root.end(5_000)
    tracing.flush()
    publish, request = trace_sink.spans
    assert (publish.name, publish.start_ns, publish.end_ns) == ("ingress.publish", 2_000, 3_000)
    assert publish.parent_id == root.context.span_id == request.span_id
    assert request.parent_id is None
    assert request.attributes == {"request_id": "r1"}
    assert {s.trace_id for s in trace_sink.spans} == {root.context.trace_id}


def test_a_client_that_did_not_sample_its_trace_gets_nothing_recorded(
    trace_sink: tracing.MemorySink,
) -> None:
    tracer = tracing.Tracer("ingress")
    unsampled = tracecontext.new_trace(sampled=False)
    span = tracer.begin(tracing.ROOT, unsampled)
    assert not span.recording
    assert span.context == unsampled
    span.end()
    tracing.flush()
    assert trace_sink.spans == []


def test_the_sample_rate_decides_for_traces_started_here() -> None:
    sink = tracing.MemorySink()
    tracing.use([sink], sample=0.0)
    try:
        assert tracing.Tracer("ingress").begin(tracing.ROOT, None).context is None
        # ... but not for a client's own sampled trace.
        assert tracing.Tracer("ingress").begin(tracing.ROOT, tracecontext.new_trace()).recording
    finally:
        tracing.use([])
    with pytest.raises(ValueError, match="sample"):
        tracing.use([sink], sample=1.5)


def test_the_file_sink_rotates_and_keeps_one_old_file(tmp_path: Path) -> None:
    span = tracing.FinishedSpan("worker", "worker.read", "a" * 32, "b" * 16, None, 1, 2, {})
    line = len(json.dumps(span.to_json(), separators=(",", ":"))) + 1
    sink = tracing.FileSink(tmp_path, "worker", max_bytes=3 * line)
    for _ in range(7):
        sink.export([span])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [sink.path.name, sink.path.name + ".1"]
    assert all(p.stat().st_size <= 3 * line for p in tmp_path.iterdir())
    assert len(list(tracing.read_spans(tmp_path))) <= 6
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o600}


def _write(directory: Path, spans: list[tracing.FinishedSpan]) -> None:
    sink = tracing.FileSink(directory, "test", max_bytes=1 << 20)
    sink.export(spans)
    (directory / "cut.jsonl").write_text('{"trace_id": "x", "spa')  # cut short: passed over


def test_a_request_is_found_by_its_id_or_its_attempts_and_drawn(tmp_path: Path) -> None:
    t1, t2 = "1" * 32, "2" * 32
    ms = 1_000_000
    spans = [
        tracing.FinishedSpan(
            "ingress", tracing.ROOT, t1, "a" * 16, None, 0, 40 * ms, {"request_id": "req"}
        ),
        tracing.FinishedSpan("ingress", "ingress.publish", t1, "b" * 16, "a" * 16, ms, 3 * ms, {}),
        tracing.FinishedSpan("admission", "admission.read", t1, "c" * 16, "b" * 16, ms, 6 * ms, {}),
        tracing.FinishedSpan(
            "ingress", tracing.ROOT, t2, "d" * 16, None, 0, ms, {"request_id": "req.2"}
        ),
    ]
    _write(tmp_path, spans)
    assert set(traces_of(tmp_path, "req")) == {t1, t2}
    assert set(traces_of(tmp_path, t1)) == {t1}
    assert traces_of(tmp_path, "nope") == {}
    lines = waterfall(traces_in(tmp_path, {t1})[t1])
    assert len(lines) == 4
    assert lines[1].split()[:2] == ["0.0", "40.0"]
    assert lines[1].endswith(tracing.ROOT)
    assert lines[3].rstrip().endswith("    admission.read")  # two levels down


def test_stage_quantiles_count_each_stage_of_each_trace() -> None:
    ms = 1_000_000
    traces = [
        [tracing.FinishedSpan("worker", "worker.claim", f"{i:032x}", "a" * 16, None, 0, i * ms, {})]
        for i in range(1, 101)
    ]
    q = stage_quantiles(traces)
    assert q == {"worker.claim": {"p50": 50.0, "p99": 99.0, "n": 100}}
