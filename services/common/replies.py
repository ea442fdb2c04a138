"""Awaiting replies: one consumer on an owner's reply topic, routed to per-request streams.

Whoever produces requests with ``reply_to`` set to its own reply topic (an ingress
instance, the async client SDK) runs one ``ReplyRouter``; each request it is waiting on
is ``register``-ed and gets a ``ReplyStream``: its ``ReplyChunk``s in order, then its one
terminal ``InferenceReply``, after which the stream ends.

- Register *before* producing the request: a reply that arrives for a request id nobody
  registered is dropped (counted as ``orphan``), so registering late could miss a fast
  reply. The router reads from the end of the topic as it was at start: replies
  produced before ``start`` returned are not seen.
- At-least-once delivery upstream means duplicates: a chunk whose ``(generation, seq)``
  was already delivered, and anything after the terminal reply (a second terminal
  reply included), is dropped (``duplicate``). After ``unregister`` records for the id
  still count as ``duplicate`` while it is among the last ``remember`` unregistered
  ids, then as ``orphan``. ``counts`` holds this router's own tallies (the metric sums
  all routers).
- Generations (a worker died mid-stream and another started the request again): the
  stream follows the first generation it hears from; chunks and terminal replies of
  an older generation are dropped (``superseded``); a newer generation takes over while
  no text has been delivered, and otherwise ends the stream with a terminal
  ``error``/``stream_interrupted`` reply of its own (``interrupted``), never splicing
  two generations' text into one answer.
- There is no consumer group (every owner reads its own topic whole) and so no commit.
- A record that does not decode is dead-lettered when ``dead_letters`` is given, else
  logged and counted; either way the router carries on (``services.common.consuming``).
- When the router stops or its consumer fails, every open stream raises
  ``ReplyRouterClosed`` instead of leaving its reader waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Literal

from aiokafka import TopicPartition
from prometheus_client import Counter

from schemas import InferenceReply, ReasonCode, ReplyChunk, ReplyStatus
from services.common.bus import close, ensure_topics, make_consumer, topics_of
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import DeadLetters, failure_of
from services.common.lifecycle import Component
from services.common.serde import REPLY, decode
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)

ReplyItem = ReplyChunk | InferenceReply

RECORDS = Counter(
    "seawall_reply_router_records_total",
    "Reply-topic records read, by what became of them",
    ["outcome"],
)


class ReplyRouterClosed(ConnectionError):
    """The router stopped (or its consumer failed) before the terminal reply came."""


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


class ReplyRouter(Component):
    """Reads ``owner``'s reply topic (created at start) and feeds registered streams."""

    name = "reply-router"

    def __init__(
        self,
        settings: CommonSettings,
        owner: str,
        *,
        dead_letters: DeadLetters | None = None,
        clock: Clock = SYSTEM_CLOCK,
        remember: int = 10_000,
    ) -> None:
        super().__init__()
        self.counts: Tally[str] = Tally()
        """Records read by this router, by outcome (as the metric's ``outcome`` label)."""
        self._remember = remember
        self._done: OrderedDict[str, None] = OrderedDict()
        self._settings = settings
        self._spec = topics_of(settings).reply_spec(owner)
        self._dead_letters = dead_letters
        self._clock = clock
        self._streams: dict[str, ReplyStream] = {}
        self._consumer = make_consumer(settings, group_id=None)
        self._loop: ConsumerLoop[None] = ConsumerLoop(
            self._consumer,
            self,
            dead_letters,
            name=self.name,
            commit=False,
            concurrency=1,  # in record order: a request's chunks stay in sequence
            start_consumer=False,
        )

    @property
    def topic(self) -> str:
        """The reply topic: what requests carry as ``reply_to``."""
        return self._spec.name

    def register(self, request_id: str) -> ReplyStream:
        if not self.running:
            raise ReplyRouterClosed("the reply router is not running")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already registered")
        stream = self._streams[request_id] = ReplyStream(request_id, self._clock)
        return stream

    def unregister(self, request_id: str) -> None:
        """Stop routing a request's records (idempotent); see the module notes."""
        if self._streams.pop(request_id, None) is not None and self._remember:
            self._done[request_id] = None
            if len(self._done) > self._remember:
                self._done.popitem(last=False)

    @property
    def waiting(self) -> int:
        return len(self._streams)

    async def on_start(self) -> None:
        s = self._settings
        await ensure_topics(s.kafka_bootstrap, [self._spec], s.topic_replication)
        consumer = self._consumer
        await consumer.start()
        await consumer.topics()  # loads the metadata: the partitions of our topic
        partitions = consumer.partitions_for_topic(self.topic) or {0}
        assigned = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_end(*assigned)
        for tp in assigned:
            # Resolve the position now: a lazy one would be taken at the first fetch,
            # after a fast reply to an early request could already have landed.
            await consumer.position(tp)
        await self._loop.start()
        self.spawn(self._watch(), "watch")

    async def _watch(self) -> None:
        await self._loop.failed.wait()
        self._close_all("the reply router's consumer failed")
        raise RuntimeError("the reply router's loop failed") from self._loop.failure

    async def on_stop(self) -> None:
        await self._loop.stop()
        self._close_all("the reply router stopped")
        await close(self._consumer)

    def _close_all(self, why: str) -> None:
        error = ReplyRouterClosed(why)
        for stream in self._streams.values():
            stream.close(error)
        self._streams.clear()

    # -- the handler (services.common.consuming.Handler) ---------------------------
    async def decide(self, record: Record) -> None:
        item = decode(REPLY, record.value)
        stream = self._streams.get(item.request_id)
        if stream is None:
            self._count("duplicate" if item.request_id in self._done else "orphan")
        else:
            self._count(stream.deliver(item))

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        self._count("undecodable")
        if self._dead_letters is None:
            reason, _ = failure_of(error)
            log.warning(
                "unusable reply record skipped",
                extra={"topic": record.topic, "offset": record.offset, "reason": reason},
            )
            return
        await self._dead_letters.record(record, error)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        RECORDS.labels(outcome).inc()
