"""An ingress instance awaiting its replies: one consumer on its reply topic, routed to
per-request streams (``seawall_client.streams``: duplicates, generations and the rules
of registering are described there; the client SDK reads its own topic the same way).

- The router reads from the end of the topic as it was at start: replies produced
  before ``start`` returned are not seen. ``counts`` holds this router's own tallies
  (the metric sums all routers).
- There is no consumer group (every owner reads its own topic whole) and so no commit.
- A record that does not decode is dead-lettered when ``dead_letters`` is given, else
  logged and counted; either way the router carries on (``services.common.consuming``).
- When the router stops or its consumer fails, every open stream raises
  ``ReplyRouterClosed`` instead of leaving its reader waiting for ever.
- Given the instance's ``producer``, the router keeps its topic alive with a heartbeat
  record every ``heartbeat_s`` and deletes it when it stops, unless a reply may still
  come to it (``seawall_client.reply_upkeep``); heartbeats are skipped unread. What a
  killed instance leaves behind is swept (``reply_sweeper``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally

from aiokafka import AIOKafkaProducer
from prometheus_client import Counter

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import DELETE_TIMEOUT_S, close, ensure_topics, start_tail
from seawall_client.reply_upkeep import HEARTBEAT_S, beat, delete_own, is_heartbeat, keep_alive
from seawall_client.serde import REPLY, decode
from seawall_client.streams import ReplyRouterClosed, ReplyRoutes, ReplyStream
from services.common.bus import make_consumer, topics_of
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import DeadLetters, failure_of
from services.common.lifecycle import Component
from services.common.settings import CommonSettings
from services.common.tracing import produced_at_ns

log = logging.getLogger(__name__)

RECORDS = Counter(
    "seawall_reply_router_records_total",
    "Reply-topic records read, by what became of them",
    ["outcome"],
)


class ReplyRouter(Component):
    """Reads ``owner``'s reply topic (created at start) and feeds registered streams;
    with a ``producer``, keeps the topic alive and deletes it at stop (module notes):
    ``reply_due_s`` is how long a request given up on may still be answered."""

    name = "reply-router"

    def __init__(
        self,
        settings: CommonSettings,
        owner: str,
        *,
        dead_letters: DeadLetters | None = None,
        clock: Clock = SYSTEM_CLOCK,
        remember: int = 10_000,
        producer: AIOKafkaProducer | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        reply_due_s: float = 180.0,
        delete_timeout_s: float = DELETE_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self._producer = producer
        self._heartbeat_s = heartbeat_s
        self._reply_due_s = reply_due_s
        self._delete_timeout_s = delete_timeout_s
        self._keeper: asyncio.Task[None] | None = None
        self._routes = ReplyRoutes(clock, remember)
        self._produced: dict[str, list[int]] = {}
        self._settings = settings
        self._spec = topics_of(settings).reply_spec(owner)
        self._dead_letters = dead_letters
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

    @property
    def counts(self) -> Tally[str]:
        """Records read by this router, by outcome (as the metric's ``outcome`` label)."""
        return self._routes.counts

    @property
    def waiting(self) -> int:
        return self._routes.waiting

    def register(self, request_id: str, *, traced: bool = False) -> ReplyStream:
        """The stream of ``request_id``'s replies; ``traced``: keep when each reply the
        stream is given was produced (``produced_ns``), for its trace."""
        if not self.running:
            raise ReplyRouterClosed("the reply router is not running")
        stream = self._routes.register(request_id)
        if traced:
            self._produced[request_id] = []
        return stream

    def unregister(self, request_id: str) -> None:
        self._routes.unregister(request_id)
        self._produced.pop(request_id, None)

    def produced_ns(self, request_id: str) -> list[int]:
        """When each reply delivered to a traced request's stream was produced (the
        records' timestamps, in Unix nanoseconds), in the order delivered."""
        return self._produced.get(request_id, [])

    async def on_start(self) -> None:
        s = self._settings
        await ensure_topics(s.kafka, [self._spec])
        await start_tail(self._consumer, self.topic)
        await self._loop.start()
        self.spawn(self._watch(), "watch")
        if self._producer is not None:
            await beat(self._producer, self.topic)
            self._keeper = self.spawn(
                keep_alive(self._producer, self.topic, self._heartbeat_s), "heartbeat"
            )

    async def _watch(self) -> None:
        await self._loop.failed.wait()
        self._routes.close_all("the reply router's consumer failed")
        raise RuntimeError("the reply router's loop failed") from self._loop.failure

    async def on_stop(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        await self._loop.stop()
        settled = self._routes.settled(self._reply_due_s)
        self._routes.close_all("the reply router stopped")
        await close(self._consumer)
        if self._producer is None:
            return
        if settled:
            await delete_own(self._settings.kafka, self.topic, self._delete_timeout_s)
        else:
            log.info(
                "reply topic kept: a reply may still come; the sweeper deletes it",
                extra={"topic": self.topic},
            )

    # -- the handler (services.common.consuming.Handler) ---------------------------
    async def decide(self, record: Record) -> None:
        if is_heartbeat(record.headers):
            RECORDS.labels("heartbeat").inc()
            return
        item = decode(REPLY, record.value)
        outcome = self._routes.route(item)
        RECORDS.labels(outcome).inc()
        if outcome == "delivered" and self._produced:
            produced = self._produced.get(item.request_id)
            if produced is not None:
                produced.append(produced_at_ns(record))

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        self._routes.counts["undecodable"] += 1
        RECORDS.labels("undecodable").inc()
        if self._dead_letters is None:
            reason, _ = failure_of(error)
            log.warning(
                "unusable reply record skipped",
                extra={"topic": record.topic, "offset": record.offset, "reason": reason},
            )
            return
        await self._dead_letters.record(record, error)
