"""The worker's coalescer: the first text leaves at once, the rest within its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.workers.policy.chunker import Chunk, Coalescer

pytestmark = pytest.mark.unit


def test_the_first_token_is_a_chunk_without_waiting_for_a_second() -> None:
    c = Coalescer(max_tokens=16, max_interval_s=0.1)
    assert c.add("Hello", 1, now=0.0) == Chunk(0, "Hello", 1)
    assert c.chunks_sent == 1


def test_after_the_first_chunk_tokens_gather_until_the_token_bound() -> None:
    c = Coalescer(max_tokens=3, max_interval_s=10.0)
    c.add("a", 1, now=0.0)
    assert c.add("b", 1, now=0.01) is None
    assert c.add("c", 1, now=0.02) is None
    assert c.add("d", 1, now=0.03) == Chunk(1, "bcd", 3)


def test_after_the_first_chunk_a_chunk_leaves_when_its_first_delta_is_old_enough() -> None:
    c = Coalescer(max_tokens=100, max_interval_s=0.1)
    c.add("a", 1, now=0.0)
    assert c.add("b", 1, now=1.0) is None  # its own age starts here
    assert c.add("c", 1, now=1.05) is None
    assert c.add("d", 1, now=1.1) == Chunk(1, "bcd", 3)


def test_an_empty_first_delta_waits_for_text() -> None:
    c = Coalescer(max_tokens=16, max_interval_s=0.1)
    assert c.add("", 0, now=0.0) is None
    # A delta of tokens without text (a special token, say) is no first text either.
    assert c.add("", 1, now=0.01) is None
    assert c.add("x", 1, now=0.02) == Chunk(0, "x", 2)


def test_flush_returns_what_is_pending_once() -> None:
    c = Coalescer(max_tokens=16, max_interval_s=0.1)
    c.add("a", 1, now=0.0)
    c.add("b", 1, now=0.01)
    assert c.flush() == Chunk(1, "b", 1)
    assert c.flush() is None


@given(
    st.lists(st.tuples(st.text(min_size=1, max_size=4), st.integers(1, 3)), max_size=60),
    st.integers(1, 20),
    st.floats(0.0, 0.5),
)
def test_chunks_carry_every_delta_in_order_and_respect_the_token_bound(
    deltas: list[tuple[str, int]], max_tokens: int, interval: float
) -> None:
    c = Coalescer(max_tokens=max_tokens, max_interval_s=interval)
    chunks: list[Chunk] = []
    for i, (text, tokens) in enumerate(deltas):
        chunk = c.add(text, tokens, now=i * 0.011)
        if chunk is not None:
            chunks.append(chunk)
    tail = c.flush()
    if tail is not None:
        chunks.append(tail)
    assert "".join(ch.text for ch in chunks) == "".join(t for t, _ in deltas)
    assert sum(ch.tokens for ch in chunks) == sum(n for _, n in deltas)
    assert [ch.seq for ch in chunks] == list(range(len(chunks)))
    if chunks:
        assert chunks[0].text == deltas[0][0]  # the first text alone
    # A chunk never holds more than one delta past the token bound.
    assert all(ch.tokens < max_tokens + 3 for ch in chunks)
