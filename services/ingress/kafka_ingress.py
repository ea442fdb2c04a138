"""The Kafka ingress: requests that producers post straight onto ``llm.ingress``.

They go through the same gate as HTTP requests (``pipeline.py``); the producer names
its tenant by ``api_key_id`` (the key id, never the key), and the tenant, tier and
priority are taken from that key's record, whatever the record says.

Per batch, at-least-once: every record is judged (concurrently: the key lookups are the
slow part), then, in record order, its effect is queued — the request onto its
priority topic, a terminal ``rejected`` reply onto the producer's ``reply_to``, or a
dead letter — and the batch is committed once every effect is acknowledged. A crash
before the commit means the batch comes again; its duplicates carry the same request
ids and are dropped downstream.

- An ``AbortRequest`` from a live key sets the abort marker of its request id (as HTTP
  ingress does when its client goes away); one from a key that is not live is
  dead-lettered with the refusal's code.
- A record that does not decode is dead-lettered (``invalid_json``, ...), and so is one
  whose ``reply_to`` is not a reply topic (``invalid_reply_to``): ingress writes
  replies onto reply topics only, never onto a topic a producer merely names.
- A record that decodes but fails a filter (oversize, blacklisted client, unknown or
  retired key id, sensitive data under ``block``, absurd ``max_tokens``) gets a
  terminal ``rejected`` reply, and nothing reaches the priority topics.
- Redis not answering: the batch is read again after ``redis_retry_s``. Kafka failing:
  the component fails and the process exits for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, TypeAlias

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord
from redis.exceptions import RedisError

from schemas import AbortRequest, InferenceReply, InferenceRequest, ReplyStatus
from services.common.bus import dead_letter_record, make_consumer
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.lifecycle import Component, cancel_tasks
from services.common.serde import INGRESS, DecodeError, decode, encode
from services.common.topics import Topics
from services.ingress import metrics as m
from services.ingress.pipeline import Gate, Refusal
from services.ingress.settings import IngressSettings

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]


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
        producer: AIOKafkaProducer,
        topics: Topics,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._gate = gate
        self._producer = producer
        self._topics = topics
        self._clock = clock
        self._reply_prefix = topics.reply("")
        self._consumer: AIOKafkaConsumer | None = None
        self._loop: asyncio.Task[Any] | None = None
        self._consuming = False
        self._stopping = False

    async def on_start(self) -> None:
        consumer = make_consumer(
            self._settings, group_id=f"{self._settings.topic_prefix}seawall.ingress"
        )
        self._consumer = consumer
        consumer.subscribe([self._topics.ingress])
        self._loop = self.spawn(self._consume(consumer), "consume")

    async def on_stop(self) -> None:
        self._stopping = True
        if self._loop is not None:
            if self._consuming:
                # Let the batch in hand finish and commit; what does not is redelivered.
                await asyncio.wait({self._loop}, timeout=self._settings.shutdown_grace_s)
            else:
                await cancel_tasks({self._loop})
        if self._consumer is not None:
            await self._consumer.stop()

    async def _consume(self, consumer: AIOKafkaConsumer) -> None:
        # Joining the group takes a rebalance (seconds): the rest of ingress, HTTP
        # included, does not wait for it.
        await consumer.start()
        self._consuming = True
        while not self._stopping:
            batches = await consumer.getmany(
                timeout_ms=200, max_records=self._settings.kafka_max_batch
            )
            if batches:
                await self._handle(consumer, batches)

    async def _handle(
        self, consumer: AIOKafkaConsumer, batches: dict[TopicPartition, list[Record]]
    ) -> None:
        records = [r for rs in batches.values() for r in rs]
        results = await asyncio.gather(*(self._judge(r) for r in records), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if any(not isinstance(f, RedisError) for f in failures):
            raise next(f for f in failures if not isinstance(f, RedisError))
        if failures:
            log.warning(
                "redis unavailable; retrying the batch",
                extra={"records": len(records), "error": type(failures[0]).__name__},
            )
            for tp, rs in batches.items():
                consumer.seek(tp, rs[0].offset)
            await asyncio.sleep(self._settings.redis_retry_s)
            return
        acks = []
        for record, effect in zip(records, results, strict=True):
            assert not isinstance(effect, BaseException)
            ack = await self._apply(record, effect)
            if ack is not None:
                acks.append(ack)
        await asyncio.gather(*acks)
        try:
            await consumer.commit({tp: rs[-1].offset + 1 for tp, rs in batches.items()})
        except CommitFailedError as e:
            # A rebalance took the partitions: their new owner handles them again.
            log.warning("commit failed", extra={"error": str(e)})

    async def _judge(self, record: Record) -> _Effect:
        try:
            request = decode(INGRESS, record.value)
        except DecodeError as e:
            return _DeadLetter(e)
        if isinstance(request, AbortRequest):
            return await self._judge_abort(request)
        reply_to = request.reply_to
        if not reply_to.startswith(self._reply_prefix) or reply_to == self._reply_prefix:
            return _DeadLetter(
                DecodeError("invalid_reply_to", f"reply_to must be a '{self._reply_prefix}*' topic")
            )
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
        # Set here, not when applying: a Redis failure then retries the batch like a
        # failed key lookup does. The marker is idempotent.
        await self._gate.abort(abort.request_id, abort.deadline_at, abort.cause)
        return _Aborted()

    async def _apply(self, record: Record, effect: _Effect) -> asyncio.Future[Any] | None:
        """Queue the effect; the future of its ack (``None``: already acknowledged)."""
        if isinstance(effect, _Publish):
            m.REQUESTS.labels("kafka", "published").inc()
            return await self._gate.publish(effect.request)
        if isinstance(effect, _Reject):
            m.REQUESTS.labels("kafka", "refused").inc()
            m.REFUSALS.labels("kafka", effect.refusal.code).inc()
            request = effect.request
            reply = InferenceReply(
                request_id=request.request_id,
                status=ReplyStatus.REJECTED,
                reason=effect.refusal.reason,
                message=effect.refusal.message[:512],
                completed_at=self._clock.time(),
            )
            try:
                fut: asyncio.Future[Any] = await self._producer.send(
                    request.reply_to, encode(reply), key=request.request_id.encode()
                )
            except KafkaTimeoutError:  # no such topic
                error = f"could not deliver to {request.reply_to!r}"
                await self._dead_letter(record, DecodeError("reply_topic_unreachable", error))
                return None
            return fut
        if isinstance(effect, _Aborted):
            m.REQUESTS.labels("kafka", "aborted").inc()
            return None
        m.REQUESTS.labels("kafka", "dead_letter").inc()
        await self._dead_letter(record, effect.error)
        return None

    async def _dead_letter(self, record: Record, error: DecodeError) -> None:
        await dead_letter_record(
            self._producer,
            self._topics,
            record,
            error,
            service=f"ingress:{self._settings.instance_id}",
            clock=self._clock,
        )
