"""Coalescing token deltas into reply chunks (pure).

An engine yields a delta per token (or a few); one Kafka record per token would cost
the broker and the client far more than the tokens are worth. The first delta that
carries text is a chunk of its own, sent at once: a streaming client's time to first
token is the engine's, not the engine's plus a coalescing wait. After it, a chunk is
flushed once it holds ``max_tokens`` tokens or its first delta is ``max_interval_s``
old, so a reply costs a handful of records and the text after the first token still
arrives within the interval. The age is checked when a delta arrives: an engine that
stalls holds its partial chunk until the next delta or the end of the request, which
is when there is news anyway.

What the bounds cost is measured in ``bench/overhead.py`` (records a request and the
client's inter-token gaps); the worker's defaults are in ``WorkerSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chunk:
    seq: int
    text: str
    tokens: int


class Coalescer:
    def __init__(self, max_tokens: int = 16, max_interval_s: float = 0.1) -> None:
        if max_tokens < 1 or max_interval_s < 0:
            raise ValueError("max_tokens must be at least 1 and max_interval_s not negative")
        self._max_tokens = max_tokens
        self._max_interval_s = max_interval_s
        self._parts: list[str] = []
        self._tokens = 0
        self._since: float | None = None
        self._seq = 0

    def add(self, text: str, tokens: int, now: float) -> Chunk | None:
        """Take a delta; return a chunk when it is the first text or a bound is reached."""
        if not text and not tokens:
            return None
        if self._since is None:
            self._since = now
        self._parts.append(text)
        self._tokens += tokens
        if (
            (self._seq == 0 and text)
            or self._tokens >= self._max_tokens
            or now - self._since >= self._max_interval_s
        ):
            return self.flush()
        return None

    def flush(self) -> Chunk | None:
        """What is pending, if anything (call at the end of the request)."""
        if not self._parts:
            return None
        chunk = Chunk(self._seq, "".join(self._parts), self._tokens)
        self._seq += 1
        self._parts, self._tokens, self._since = [], 0, None
        return chunk

    @property
    def chunks_sent(self) -> int:
        return self._seq
