"""Routing replies to the requests waiting on them: per-request streams that drop
what at-least-once delivery repeats and never splice two generations' text.

A reader of a reply topic (an ingress instance, ``SeawallClient``) keeps one
``ReplyRoutes``; each request it waits on is ``register``-ed and gets a ``ReplyStream``:
its ``ReplyChunk``s in order, then its one terminal ``InferenceReply``, after which the
stream ends. No I/O here: the reader feeds ``route`` with what it decodes.

- Register *before* producing the request: a reply for a request id nobody registered
  is dropped (``orphan``), so registering late could miss a fast reply.
- At-least-once delivery upstream means duplicates: a chunk whose ``(generation, seq)``
  was already delivered, and anything after the terminal reply (a second terminal
  reply included), is dropped (``duplicate``). After ``unregister`` records for the id
  still count as ``duplicate`` while it is among the last ``remember`` unregistered
  ids, then as ``orphan``.
- Generations (a worker died mid-stream and another started the request again): the
  stream follows the first generation it hears from; chunks and terminal replies of
  an older generation are dropped (``superseded``); a newer generation takes over while
  no text has been delivered, and otherwise ends the stream with a terminal
  ``error``/``stream_interrupted`` reply of its own (``interrupted``), never splicing
  two generations' text into one answer.
- ``close_all`` (the reader stopped or failed) makes every open stream raise
  ``ReplyRouterClosed`` instead of leaving its reader waiting for ever.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from typing import Literal

from schemas import InferenceReply, ReasonCode, ReplyChunk, ReplyStatus
from seawall_client.clock import SYSTEM_CLOCK, Clock

ReplyItem = ReplyChunk | InferenceReply


class ReplyRouterClosed(ConnectionError):
    """The reader of the reply topic stopped (or failed) before the terminal reply came."""


Outcome = Literal["delivered", "duplicate", "superseded", "interrupted"]

INTERRUPTED_MESSAGE = (
    "The worker streaming this reply failed after text had been sent, and the request "
    "was started again: the text streamed so far is void."
)


class ReplyStream:
    """One request's replies: chunks (each ``(generation, seq)`` once, of one
    generation), then the terminal reply.

    Iterate it (``async for item in stream``) to get every item, the terminal reply
    last; or ``await stream.result()`` for the terminal reply alone. Bound the wait
    with ``asyncio.timeout``: the stream itself never times out.
    """

    def __init__(self, request_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self.request_id = request_id
        self.terminal: InferenceReply | None = None
        """The terminal reply once the router has received it (it may not be read yet)."""
        self._clock = clock
        self._queue: asyncio.Queue[ReplyItem | ReplyRouterClosed] = asyncio.Queue()
        self._generation: int | None = None
        """The generation whose chunks are delivered (``None``: none yet)."""
        self._text_sent = False
        """Whether a chunk of ``_generation`` with text has been delivered."""
        self._seqs: set[int] = set()
        self._finished = False

    def deliver(self, item: ReplyItem) -> Outcome:
        """Queue ``item`` unless it is a duplicate or superseded (module notes)."""
        if self.terminal is not None:
            return "duplicate"
        gen = item.generation
        if isinstance(item, InferenceReply):
            if self._generation is None or gen in (0, self._generation) or not self._text_sent:
                return self._end(item)
            if gen < self._generation:
                return "superseded"
            self._end(self._interrupted(gen))
            return "interrupted"
        if self._generation is not None and gen != self._generation:
            if gen < self._generation:
                return "superseded"
            if self._text_sent:
                self._end(self._interrupted(gen))
                return "interrupted"
            self._seqs.clear()
        self._generation = gen
        if item.seq in self._seqs:
            return "duplicate"
        self._seqs.add(item.seq)
        self._text_sent = self._text_sent or bool(item.text)
        self._queue.put_nowait(item)
        return "delivered"

    def _end(self, reply: InferenceReply) -> Outcome:
        self.terminal = reply
        self._queue.put_nowait(reply)
        return "delivered"

    def _interrupted(self, generation: int) -> InferenceReply:
        return InferenceReply(
            request_id=self.request_id,
            status=ReplyStatus.ERROR,
            reason=ReasonCode.STREAM_INTERRUPTED,
            message=INTERRUPTED_MESSAGE,
            generation=generation,
            completed_at=self._clock.time(),
        )

    def close(self, error: ReplyRouterClosed) -> None:
        """Wake the reader with ``error`` (after whatever is queued) unless it is done."""
        if self.terminal is None:
            self._queue.put_nowait(error)

    async def next(self) -> ReplyItem:
        """The next item; raises ``StopAsyncIteration`` after the terminal reply and
        ``ReplyRouterClosed`` if the router went away first."""
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, ReplyRouterClosed):
            raise item
        if isinstance(item, InferenceReply):
            self._finished = True
        return item

    def __aiter__(self) -> AsyncIterator[ReplyItem]:
        return self

    async def __anext__(self) -> ReplyItem:
        return await self.next()

    async def result(self) -> InferenceReply:
        """Skip the chunks; the terminal reply."""
        async for item in self:
            if isinstance(item, InferenceReply):
                return item
        raise AssertionError("a finished stream has delivered its terminal reply")


class ReplyRoutes:
    """The open streams of one reply topic's reader, by request id (module notes)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, remember: int = 10_000) -> None:
        self.counts: Counter[str] = Counter()
        """Records routed, by outcome (``orphan`` and ``Outcome``); readers add
        ``undecodable``."""
        self._clock = clock
        self._remember = remember
        self._done: OrderedDict[str, None] = OrderedDict()
        self._streams: dict[str, ReplyStream] = {}
        self.abandoned_at: float | None = None
        """When (``clock.monotonic``) a stream was last unregistered before its terminal
        reply came (``settled``)."""

    @property
    def waiting(self) -> int:
        return len(self._streams)

    def register(self, request_id: str) -> ReplyStream:
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already registered")
        stream = self._streams[request_id] = ReplyStream(request_id, self._clock)
        return stream

    def unregister(self, request_id: str) -> None:
        """Stop routing a request's records (idempotent); see the module notes."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if stream.terminal is None:
            self.abandoned_at = self._clock.monotonic()
        if self._remember:
            self._done[request_id] = None
            if len(self._done) > self._remember:
                self._done.popitem(last=False)

    def settled(self, due_s: float) -> bool:
        """Whether no reply can still be on its way: no stream is open, and none was
        unregistered before its terminal reply (timed out, abandoned) within the last
        ``due_s`` (the longest a request given up on may still be answered). The owner
        of the reply topic deletes it on close only then (``reply_upkeep``)."""
        if self._streams:
            return False
        return self.abandoned_at is None or self._clock.monotonic() - self.abandoned_at >= due_s

    def route(self, item: ReplyItem) -> str:
        """Hand ``item`` to its stream; what became of it (counted in ``counts``)."""
        stream = self._streams.get(item.request_id)
        if stream is None:
            outcome = "duplicate" if item.request_id in self._done else "orphan"
        else:
            outcome = stream.deliver(item)
        self.counts[outcome] += 1
        return outcome

    def close_all(self, why: str) -> None:
        error = ReplyRouterClosed(why)
        for stream in self._streams.values():
            stream.close(error)
        self._streams.clear()
