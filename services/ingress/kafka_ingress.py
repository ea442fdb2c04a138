"""The Kafka ingress: requests that producers post straight onto ``llm.ingress``.

They go through the same gate as HTTP requests (``pipeline.py``); the producer names
its tenant by ``api_key_id`` (the key id, never the key), and the tenant, tier and
priority are taken from that key's record, whatever the record says.

It is a ``ConsumerLoop`` (``services.common.consuming``): per fetched batch, every
record is judged (``decide``: at most ``redis_fanout`` at once, the key lookups being
the slow part), then, in record order, its effect is queued — the request onto its
priority topic, a terminal ``rejected`` reply onto the producer's ``reply_to``, or a
dead letter — and the batch is committed once every effect is acknowledged. A crash
before the commit means the batch comes again; its duplicates carry the same request
ids and are dropped downstream.

- An ``AbortRequest`` from a live key sets the abort marker of its request id (as HTTP
  ingress does when its client goes away); one from a key that is not live is
  dead-lettered with the refusal's code.
- A record that does not decode is dead-lettered (``invalid_json``, ...), and so is one
  whose ``reply_to`` is not a reply topic (``invalid_reply_to``) or names one that does
  not exist (``reply_topic_unreachable``): ingress writes replies onto existing reply
  topics only, never onto a topic a producer merely names.
- A record that decodes but fails a filter (oversize, blacklisted client, unknown or
  retired key id, sensitive data under ``block``, absurd ``max_tokens``) gets a
  terminal ``rejected`` reply, and nothing reaches the priority topics. So does one
  whose processing fails for any other reason of its own (``processing_error``).
- Redis or the broker not answering: the records are judged again after a backoff.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer

from schemas import AbortRequest, InferenceReply, InferenceRequest, ReasonCode, ReplyStatus
from services.common.bus import make_consumer
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies, Undeliverable
from services.common.lifecycle import Component
from services.common.serde import INGRESS, DecodeError, decode
from services.common.topics import Topics
from services.ingress import metrics as m
from services.ingress.pipeline import Gate, Refusal
from services.ingress.settings import IngressSettings


@dataclass(frozen=True, slots=True)
class _Publish:
    request: InferenceRequest


@dataclass(frozen=True, slots=True)
class _Reject:
    request: InferenceRequest
    refusal: Refusal


@dataclass(frozen=True, slots=True)
class _Aborted:
    """The abort marker is set; nothing is left to apply."""


@dataclass(frozen=True, slots=True)
class _DeadLetter:
    error: DecodeError


_Effect = _Publish | _Reject | _Aborted | _DeadLetter


class KafkaIngress(Component):
    name = "kafka-ingress"

    def __init__(
        self,
        settings: IngressSettings,
        gate: Gate,
        replies: Replies,
        dead_letters: DeadLetters,
        topics: Topics,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._gate = gate
        self._replies = replies
        self._dead_letters = dead_letters
        self._topics = topics
        self._clock = clock
        consumer: AIOKafkaConsumer = make_consumer(
            settings, group_id=f"{settings.topic_prefix}seawall.ingress"
        )
        consumer.subscribe([topics.ingress])
        self.loop: ConsumerLoop[_Effect] = ConsumerLoop(
            consumer,
            self,
            dead_letters,
            name=self.name,
            commit=True,
            max_records=settings.kafka_max_batch,
            concurrency=settings.redis_fanout,
            grace_s=settings.shutdown_grace_s,
        )

    async def on_start(self) -> None:
        await self.loop.start()
        self.spawn(self._watch(), "watch")

    async def _watch(self) -> None:
        await self.loop.failed.wait()
        raise RuntimeError("the Kafka ingress loop failed") from self.loop.failure

    async def on_stop(self) -> None:
        await self.loop.stop()

    # -- the handler (services.common.consuming.Handler) ---------------------------
    async def decide(self, record: Record) -> _Effect:
        try:
            request = decode(INGRESS, record.value)
        except DecodeError as e:
            return _DeadLetter(e)
        if isinstance(request, AbortRequest):
            return await self._judge_abort(request)
        try:
            await self._replies.check(request.reply_to)
        except Undeliverable as e:
            return _DeadLetter(e)
        gate = self._gate
        user_agent = request.client.user_agent
        refusal = gate.check_size(record.value, self._settings.max_record_bytes) or (
            gate.check_user_agent(user_agent) if user_agent else None
        )
        if refusal is not None:
            return _Reject(request, refusal)
        principal = await gate.identify(request.api_key_id)
        if isinstance(principal, Refusal):
            return _Reject(request, principal)
        prepared = await gate.prepare(request, principal)
        if isinstance(prepared, Refusal):
            return _Reject(request, prepared)
        return _Publish(prepared)

    async def _judge_abort(self, abort: AbortRequest) -> _Effect:
        principal = await self._gate.identify(abort.api_key_id)
        if isinstance(principal, Refusal):
            # No reply topic to answer on: the refusal goes to the dead letters.
            return _DeadLetter(DecodeError(principal.code, principal.message))
        # Set here, not when applying: a Redis failure then retries the record like a
        # failed key lookup does. The marker is idempotent.
        await self._gate.abort(abort.request_id, abort.deadline_at, abort.cause)
        return _Aborted()

    async def effect(self, record: Record, decision: _Effect) -> asyncio.Future[Any] | None:
        if isinstance(decision, _Publish):
            m.REQUESTS.labels("kafka", "published").inc()
            return await self._gate.publish(decision.request)
        if isinstance(decision, _Reject):
            m.REQUESTS.labels("kafka", "refused").inc()
            m.REFUSALS.labels("kafka", decision.refusal.code).inc()
            return await self._reject(decision.request, decision.refusal)
        if isinstance(decision, _Aborted):
            m.REQUESTS.labels("kafka", "aborted").inc()
            return None
        m.REQUESTS.labels("kafka", "dead_letter").inc()
        await self._dead_letters.record(record, decision.error)
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        """A record whose reply cannot be delivered, or whose processing failed: answer
        it where its reply topic allows, else dead-letter it."""
        if not isinstance(error, DecodeError):
            try:
                request = decode(INGRESS, record.value)
            except DecodeError:
                request = None
            if isinstance(request, InferenceRequest):
                reason, message = failure_of(error)
                refusal = Refusal(ReasonCode.INVALID_REQUEST, reason, message)
                try:
                    await (await self._reject(request, refusal))
                except Undeliverable as undeliverable:
                    error = undeliverable
                else:
                    return
        m.REQUESTS.labels("kafka", "dead_letter").inc()
        await self._dead_letters.record(record, error)

    async def _reject(self, request: InferenceRequest, refusal: Refusal) -> asyncio.Future[Any]:
        reply = InferenceReply(
            request_id=request.request_id,
            status=ReplyStatus.REJECTED,
            reason=refusal.reason,
            code=refusal.code,
            message=refusal.message[:512],
            completed_at=self._clock.time(),
        )
        return await self._replies.send(request.reply_to, reply, request.request_id)
