"""Where one request's time goes: a span per stage, across every hop (W3C trace context).

Each service records its stages as spans under the trace context the request carries
(``seawall_client.tracecontext``: the HTTP header or the record header
``traceparent``) and passes its own context on in the records it produces, so that one
request reads as one waterfall from ingress to the worker and back: ingress's
``ingress.request`` (the HTTP exchange) over ``ingress.receive``, ``.authenticate``,
``.screen``, ``.publish``; admission's ``admission.read`` (from the record's produce
time: the hop included), ``.charge``, ``.schedule``, ``.dispatch``; the worker's
``worker.read``, ``.claim``, ``.first_token`` (the engine's queue and prefill),
``.publish_first_chunk`` and ``.generate``; then ``ingress.first_chunk`` and
``ingress.reply`` (from the worker's produce to the client's socket). ``STAGES`` lists
them in that order.

Spans are cheap records (a tuple's worth of fields, no context variables, explicit
times) kept in a process-wide buffer and handed to the sinks by a background thread
about once a second, so the request path never waits on an exporter:

- ``SEAWALL_TRACE_DIR``: JSON lines, one file per process, rotated at
  ``SEAWALL_TRACE_FILE_MB`` (one old file kept): what ``seawall trace <request id>``
  and ``seawall load`` read where the stack runs on one machine (``seawall up`` sets
  it), no tracing backend needed;
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): OTLP
  over HTTP to a collector, Jaeger or Tempo (``opentelemetry-sdk``'s exporter; the
  compose file runs Jaeger).

With neither, nothing is recorded and no header is added: a request costs a branch per
stage. A trace is *sampled* where it starts: a client's ``traceparent`` decides for its
own request; otherwise ingress samples ``SEAWALL_TRACE_SAMPLE`` of requests (1.0 by
default once a sink is set).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from seawall_client.tracecontext import TraceContext, new_span_id, new_trace

log = logging.getLogger(__name__)

STAGES: Final = (
    "ingress.receive",
    "ingress.read",
    "ingress.authenticate",
    "ingress.screen",
    "ingress.publish",
    "admission.read",
    "admission.charge",
    "admission.schedule",
    "admission.dispatch",
    "worker.read",
    "worker.claim",
    "worker.first_token",
    "worker.publish_first_chunk",
    "ingress.first_chunk",
    "worker.generate",
    "ingress.reply",
)
"""Every stage's span name, in the order a request meets them (``ingress.receive`` on
HTTP, ``ingress.read`` on the Kafka ingress topic)."""
ROOT: Final = "ingress.request"
"""The span of a whole HTTP exchange (or of a record on the ingress topic)."""

FLUSH_INTERVAL_S: Final = 1.0
MAX_BUFFERED: Final = 100_000
"""Spans waiting for the flusher at most; past that, new ones are dropped (and
counted): a sink that cannot keep up must not grow the process without bound."""


@dataclass(frozen=True, slots=True)
class FinishedSpan:
    """One stage of one request, as the sinks receive it (times in Unix nanoseconds)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: Mapping[str, str | int | float | bool]

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "service": self.service,
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "attributes": dict(self.attributes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FinishedSpan:
        return cls(
            service=str(data["service"]),
            name=str(data["name"]),
            trace_id=str(data["trace_id"]),
            span_id=str(data["span_id"]),
            parent_id=None if data.get("parent_id") is None else str(data["parent_id"]),
            start_ns=int(data["start_ns"]),
            end_ns=int(data["end_ns"]),
            attributes=dict(data.get("attributes") or {}),
        )

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class Sink(Protocol):
    def export(self, spans: Sequence[FinishedSpan]) -> None: ...
    def close(self) -> None: ...


class MemorySink:
    """Keeps every span (tests)."""

    def __init__(self) -> None:
        self.spans: list[FinishedSpan] = []
        self._lock = threading.Lock()

    def export(self, spans: Sequence[FinishedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def close(self) -> None:
        pass


class FileSink:
    """JSON lines in ``directory``, one file per process (``<service>-<pid>.jsonl``),
    rotated once it passes ``max_bytes`` (the previous file kept as ``.1``): at most
    twice ``max_bytes`` a process. Spans name tenants and request ids: the directory
    and files are the owner's alone (0700, 0600)."""

    def __init__(self, directory: Path, service: str, max_bytes: int) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / f"{service}-{os.getpid()}.jsonl"
        self._max_bytes = max_bytes

    def export(self, spans: Sequence[FinishedSpan]) -> None:
        text = "".join(json.dumps(s.to_json(), separators=(",", ":")) + "\n" for s in spans)
        try:
            if self.path.exists() and self.path.stat().st_size + len(text) > self._max_bytes:
                self.path.replace(self.path.with_name(self.path.name + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:  # a full disk loses spans, never a request
            log.warning("trace spans not written", extra={"error": str(e)})

    def close(self) -> None:
        pass


class OtlpSink:
    """OTLP over HTTP (protobuf) through ``opentelemetry-sdk``'s exporter, which reads
    the standard ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, timeout)."""

    def __init__(self, service: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource

        self._exporter = OTLPSpanExporter()
        self._resource = Resource.create({"service.name": f"seawall-{service}"})

    def export(self, spans: Sequence[FinishedSpan]) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        def context(trace_id: str, span_id: str) -> SpanContext:
            return SpanContext(
                int(trace_id, 16), int(span_id, 16), True, TraceFlags(TraceFlags.SAMPLED)
            )

        readable = [
            ReadableSpan(
                name=s.name,
                context=context(s.trace_id, s.span_id),
                parent=None if s.parent_id is None else context(s.trace_id, s.parent_id),
                resource=self._resource,
                attributes=dict(s.attributes),
                kind=SpanKind.SERVER if s.name == ROOT else SpanKind.INTERNAL,
                start_time=s.start_ns,
                end_time=s.end_ns,
            )
            for s in spans
        ]
        self._exporter.export(readable)

    def close(self) -> None:
        self._exporter.shutdown()  # type: ignore[no-untyped-call]


class _Recorder:
    """The process's sinks, its buffer of finished spans and the thread that flushes it."""

    def __init__(self) -> None:
        self.sinks: list[Sink] = []
        self.sample = 1.0
        self.buffer: list[FinishedSpan] = []
        self.dropped = 0
        """Spans dropped since the last flush (``MAX_BUFFERED``); the flush reports them."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def add(self, span: FinishedSpan) -> None:
        if len(self.buffer) >= MAX_BUFFERED:
            self.dropped += 1
            return
        self.buffer.append(span)

    def start(self, sinks: list[Sink], sample: float) -> None:
        self.flush()
        for sink in self.sinks:
            sink.close()
        self.sinks, self.sample = sinks, sample
        if sinks and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trace-flush", daemon=True)
            self._thread.start()
            atexit.register(self.flush)

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def flush(self) -> None:
        with self._lock:
            spans, self.buffer = self.buffer, []  # one assignment: safe beside add()
            dropped, self.dropped = self.dropped, 0
            if dropped:
                log.warning(
                    "trace spans dropped: the sinks did not keep up", extra={"spans": dropped}
                )
            if not spans:
                return
            for sink in self.sinks:
                try:
                    sink.export(spans)
                except Exception as e:  # an exporter's failure loses spans, nothing else
                    log.warning("trace export failed", extra={"error": repr(e)[:200]})


_RECORDER = _Recorder()


def configure(
    service: str,
    *,
    trace_dir: str | None,
    file_mb: float,
    sample: float,
    env: Mapping[str, str] | None = None,
) -> None:
    """Set this process's sinks from its settings and the OTLP variables (called once
    by ``run_service``): a file sink where ``trace_dir`` is set, an OTLP sink where an
    OTLP endpoint is."""
    e = os.environ if env is None else env
    sinks: list[Sink] = []
    if trace_dir:
        sinks.append(FileSink(Path(trace_dir), service, int(file_mb * 1024 * 1024)))
    if e.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or e.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        sinks.append(OtlpSink(service))
    use(sinks, sample)


def use(sinks: Iterable[Sink], sample: float = 1.0) -> None:
    """Record to ``sinks`` from now on (none: tracing off), sampling ``sample`` of the
    traces that start here."""
    if not 0.0 <= sample <= 1.0:
        raise ValueError("sample must lie within 0 and 1")
    _RECORDER.start(list(sinks), sample)


def flush() -> None:
    """Hand the buffered spans to the sinks now (tests; the thread does it each second)."""
    _RECORDER.flush()


def now_ns() -> int:
    return time.time_ns()


class _Timestamped(Protocol):
    @property
    def timestamp(self) -> int: ...


def produced_at_ns(record: _Timestamped) -> int:
    """When a Kafka record was produced (its CreateTime, in ms), in Unix nanoseconds:
    where the span of the hop that brought it starts."""
    return record.timestamp * 1_000_000


class Span:
    """A stage under way; ``end`` records it (once). ``context`` is what the next hop's
    ``traceparent`` carries: this span's, or, where nothing is recorded here, its
    parent's (passed through)."""

    __slots__ = ("_attributes", "_name", "_open", "_parent", "_start_ns", "context", "service")

    def __init__(
        self,
        service: str,
        name: str,
        context: TraceContext | None,
        parent: TraceContext | None,
        start_ns: int,
        attributes: dict[str, str | int | float | bool],
        recording: bool,
    ) -> None:
        self.service = service
        self._name = name
        self.context = context
        self._parent = parent
        self._start_ns = start_ns
        self._attributes = attributes
        self._open = recording

    @property
    def recording(self) -> bool:
        return self._open

    def set(self, **attributes: str | int | float | bool) -> None:
        if self._open:
            self._attributes.update(attributes)

    def discard(self) -> None:
        """Close the span without recording it (a request that turned out not worth a
        trace: ingress's refusals at the gate)."""
        self._open = False

    def end(self, end_ns: int | None = None) -> None:
        if not self._open:
            return
        self._open = False
        assert self.context is not None
        _RECORDER.add(
            FinishedSpan(
                self.service,
                self._name,
                self.context.trace_id,
                self.context.span_id,
                None if self._parent is None else self._parent.span_id,
                self._start_ns,
                now_ns() if end_ns is None else end_ns,
                self._attributes,
            )
        )


class Tracer:
    """A service's spans (one per module that records, like its metrics)."""

    def __init__(self, service: str) -> None:
        self.service = service

    @property
    def enabled(self) -> bool:
        return _RECORDER.enabled

    def begin(
        self, name: str, client: TraceContext | None, start_ns: int | None = None, **attributes: Any
    ) -> Span:
        """The first span of a request here: under its client's context (a
        ``traceparent`` it sent decides whether it is sampled), else the root of a new
        trace, sampled at the configured rate where this process records."""
        if client is not None:
            return self.start(name, client, start_ns, **attributes)
        sample = _RECORDER.sample
        if not _RECORDER.enabled or not (sample >= 1.0 or random.random() < sample):
            return Span(self.service, name, None, None, 0, {}, recording=False)
        return Span(
            self.service,
            name,
            new_trace(),
            None,
            now_ns() if start_ns is None else start_ns,
            attributes,
            recording=True,
        )

    def start(
        self,
        name: str,
        parent: TraceContext | None,
        start_ns: int | None = None,
        **attributes: str | int | float | bool,
    ) -> Span:
        """A span under ``parent`` from ``start_ns`` (now by default). Nothing is
        recorded without a sampled parent or a sink; the parent passes through then."""
        if parent is None or not parent.sampled or not _RECORDER.enabled:
            return Span(self.service, name, parent, parent, 0, {}, recording=False)
        context = TraceContext(parent.trace_id, new_span_id(), True)
        start = now_ns() if start_ns is None else start_ns
        return Span(self.service, name, context, parent, start, attributes, recording=True)

    def record(
        self,
        name: str,
        parent: TraceContext | None,
        start_ns: int,
        end_ns: int,
        **attributes: str | int | float | bool,
    ) -> TraceContext | None:
        """A stage already over (its times measured by the caller); its context."""
        span = self.start(name, parent, start_ns, **attributes)
        span.end(end_ns)
        return span.context


def read_spans(directory: Path) -> Iterable[FinishedSpan]:
    """Every span the file sinks wrote in ``directory`` (rotated files included); lines
    that do not parse (a file cut short while written) are passed over."""
    for path in sorted(directory.glob("*.jsonl*")):
        try:
            with path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        yield FinishedSpan.from_json(json.loads(line))
                    except (ValueError, KeyError, TypeError):
                        continue
        except OSError:
            continue
