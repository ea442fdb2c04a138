"""W3C Trace Context (``traceparent``) for records and HTTP requests (pure, no I/O).

A request's trace follows it across every hop: the HTTP header or the record header
``traceparent`` names the span that caused the next one, so a tracing backend can draw
one request's waterfall from ingress to the worker and back. The format is W3C's
(https://www.w3.org/TR/trace-context/): ``00-<trace id, 32 hex>-<span id, 16 hex>-<flags,
2 hex>``, bit 0 of the flags meaning *sampled* (someone records this trace).

A producer needs no tracing library to start a trace: ``new_trace()`` gives a context
to send in the header (``SeawallClient``'s ``traceparent`` option); the servers record
their spans under it when they trace (``services.common.tracing``). Nothing a header
says is trusted beyond naming a parent: a malformed one is ignored, as the W3C
recommends, and the request is traced (or not) as if it carried none.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

HEADER: Final = "traceparent"
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A span's place in a trace: its trace, its own id, whether the trace is sampled."""

    trace_id: str
    span_id: str
    sampled: bool = True

    @property
    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def child(self) -> TraceContext:
        """A new span in the same trace (its parent is this one)."""
        return TraceContext(self.trace_id, new_span_id(), self.sampled)


def new_span_id() -> str:
    return secrets.token_hex(8)


def new_trace(sampled: bool = True) -> TraceContext:
    """The root of a new trace."""
    return TraceContext(secrets.token_hex(16), new_span_id(), sampled)


def parse(raw: str | bytes | None) -> TraceContext | None:
    """A ``traceparent`` value; ``None`` if absent or malformed (version 00 only, no
    all-zero ids, as the W3C requires)."""
    if raw is None:
        return None
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
    match = _TRACEPARENT.fullmatch(raw.strip())
    if match is None:
        return None
    trace_id, span_id, flags = match.groups()
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceContext(trace_id, span_id, bool(int(flags, 16) & 1))


def from_headers(headers: Iterable[tuple[str, bytes]] | None) -> TraceContext | None:
    """The ``traceparent`` of a Kafka record's headers, if any (the first one)."""
    for name, value in headers or ():
        if name == HEADER:
            return parse(value)
    return None


def header(context: TraceContext | None) -> list[tuple[str, bytes]]:
    """The record header that carries ``context``; none for ``None``."""
    return [] if context is None else [(HEADER, context.header.encode())]
