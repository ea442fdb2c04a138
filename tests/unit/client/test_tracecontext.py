"""W3C trace context: what a ``traceparent`` header says, and what is ignored."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall_client import tracecontext
from seawall_client.tracecontext import TraceContext

pytestmark = pytest.mark.unit

W3C_EXAMPLE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_w3c_example_parses_and_round_trips() -> None:
    ctx = tracecontext.parse(W3C_EXAMPLE)
    assert ctx == TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", True)
    assert ctx.header == W3C_EXAMPLE
    assert tracecontext.parse(W3C_EXAMPLE.encode()) == ctx
    assert tracecontext.parse(W3C_EXAMPLE[:-2] + "00") == TraceContext(
        ctx.trace_id, ctx.span_id, False
    )


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "",
        "garbage",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # unknown version
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        b"\xff\xfe",
    ],
)
def test_a_malformed_header_is_ignored(raw: str | bytes | None) -> None:
    assert tracecontext.parse(raw) is None


def test_a_child_shares_the_trace_with_a_new_span() -> None:
    parent = tracecontext.new_trace()
    child = parent.child()
    assert child.trace_id == parent.trace_id
    assert child.span_id != parent.span_id


def test_record_headers_carry_it_and_give_it_back() -> None:
    ctx = tracecontext.new_trace()
    headers = [("seawall-key-id", b"abc"), *tracecontext.header(ctx)]
    assert tracecontext.from_headers(headers) == ctx
    assert tracecontext.header(None) == []
    assert tracecontext.from_headers(None) is None


@given(st.booleans())
def test_new_traces_are_well_formed(sampled: bool) -> None:
    ctx = tracecontext.new_trace(sampled)
    assert tracecontext.parse(ctx.header) == ctx
