"""The Kafka ingress: requests that producers post straight onto ``llm.ingress``.

A record must prove its key: it is signed with the API key (``seawall_client.signing``:
headers ``seawall-key-id``, ``seawall-timestamp``, ``seawall-signature``, an HMAC over
the timestamp, the key id and the SHA-256 of the value). Then it goes through the same
pipeline as an HTTP request (``pipeline.py``); tenant, tier and priority are the key's,
whatever the record says.

Refused without an answer, as a dead letter with the reason (``pipeline.Forged``), is
every record that does not prove its key or oversteps it: unsigned, an unknown key, a
bad signature (any byte of the value or of the headers changed), a timestamp outside
``signature_window_s``, a body naming another key id than its signature, a
``reply_to`` that is not one of the signing key's reply topics
(``llm.reply.<key id>.<owner>``: nobody can send replies into another's topic), and a
request id that another record already carried (a replay; the same record redelivered
is not one). Its ``reply_to`` is not known to reach its producer, and answering a
replay would tell the victim a lie.

It is a ``ConsumerLoop`` (``services.common.consuming``): per fetched batch, every
record is judged (``decide``: at most ``redis_fanout`` at once), then, in record order,
its effect is queued — the request onto its priority topic, a terminal ``rejected``
reply onto its reply topic, or a dead letter — and the batch is committed once every
effect is acknowledged. A crash before the commit means the batch comes again; its
duplicates carry the same request ids and are dropped downstream.

- An ``AbortRequest`` (signed too) from a live key sets the abort marker of its
  tenant's request id; one from a key that is not live is dead-lettered. Each costs
  ingress a Redis write and Redis a marker, so a key's aborts are limited
  (``kafka_aborts_per_key_per_s``, ``_burst``; a token bucket per key id in this
  process, ``denials.FailureLimiter``, so the bound holds per ingress replica): past
  it an abort sets nothing, is counted (``seawall_ingress_aborts_refused_total``) and
  dead-lettered as ``too_many_aborts`` within a sample of its own (each letter is
  kept for days), and its offset moves on like any other record's.
- A record that does not decode is dead-lettered (``invalid_json``, ...), and so is one
  whose reply topic does not exist (``reply_topic_unreachable``).
- A signed record that fails a filter (a retired key, oversize, blacklisted client,
  sensitive data under ``block``, absurd ``max_tokens``) gets a terminal ``rejected``
  reply on its key's reply topic, and nothing reaches the priority topics; so does one
  whose processing fails for any other reason of its own (``processing_error``).
- Redis or the broker not answering: the records are judged again after a backoff.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer

from schemas import AbortRequest, InferenceReply, InferenceRequest, ReasonCode, ReplyStatus
from seawall_client import tracecontext
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import INGRESS, DecodeError, decode
from seawall_client.topics import Topics
from services.common.bus import make_consumer
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies, Undeliverable
from services.common.lifecycle import Component
from services.common.tracing import ROOT, Span, now_ns, produced_at_ns
from services.ingress import metrics as m
from services.ingress.denials import FailureLimiter
from services.ingress.pipeline import Forged, IngressPipeline
from services.ingress.policy.keys import KeyRecord
from services.ingress.refusals import Refusal
from services.ingress.settings import IngressSettings
from services.ingress.tracing import TRACER


@dataclass(frozen=True, slots=True)
class _Publish:
    request: InferenceRequest
    trace: Span
    """The record's span (``ingress.request``), ended once the request is published."""


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
    sample: Literal["anonymous", "too_many_aborts"] | None = None
    """Letters of records that can come in floods are kept within a sample
    (``anonymous_dead_letters_per_s``, ``_burst``), the rest counted; each kind in a
    bucket of its own, so one flood does not use up the other's sample. ``anonymous``:
    proves no key (too large to look at, unsigned, an unknown key, a bad signature), so
    anyone who can write the topic can send it by the million; ``too_many_aborts``: an
    abort past its key's budget."""


_Effect = _Publish | _Reject | _Aborted | _DeadLetter


class KafkaIngress(Component):
    name = "kafka-ingress"

    def __init__(
        self,
        settings: IngressSettings,
        pipeline: IngressPipeline,
        replies: Replies,
        dead_letters: DeadLetters,
        topics: Topics,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._pipeline = pipeline
        self._replies = replies
        self._dead_letters = dead_letters
        self._topics = topics
        self._clock = clock
        self.anonymous = FailureLimiter(
            settings.anonymous_dead_letters_per_s, settings.anonymous_dead_letters_burst
        )
        """Samples the dead letters of floods (``_DeadLetter.sample``), a bucket each."""
        self.aborts = FailureLimiter(
            settings.kafka_aborts_per_key_per_s, settings.kafka_aborts_per_key_burst
        )
        """Abort records per key id (module notes)."""
        # Producers outside seawall (SDK clients) write this topic and ring no doorbell:
        # its consumer keeps polling at the fetch wait.
        consumer: AIOKafkaConsumer = make_consumer(
            settings, group_id=f"{settings.topic_prefix}seawall.ingress", rung=False
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
        value = record.value or b""
        limit = self._settings.max_request_bytes
        if len(value) > limit:  # before its signature or its JSON is looked at
            return _DeadLetter(
                DecodeError("too_large", f"{len(value)} bytes, above the limit of {limit}"),
                sample="anonymous",
            )
        produced = produced_at_ns(record)
        root = TRACER.begin(ROOT, tracecontext.from_headers(record.headers), produced)
        TRACER.record("ingress.read", root.context, produced, now_ns())
        span = TRACER.start("ingress.authenticate", root.context)
        key = await self._pipeline.verify_signed(record.headers, value)
        span.end()
        if isinstance(key, Forged):
            return _DeadLetter(key.error(), sample="anonymous")
        try:
            request = decode(INGRESS, value)
        except DecodeError as e:
            return _DeadLetter(e)
        forged = await self._bound_to(key, request, record)
        if forged is not None:
            return _DeadLetter(forged.error())
        principal = await self._pipeline.principal(key, "inference")
        if isinstance(request, AbortRequest):
            if isinstance(principal, Refusal):
                return _DeadLetter(DecodeError(principal.code, principal.message))
            # Only here, once the record proved its key and is no replay, does it take
            # from its key's budget: a replayed copy of someone's abort (anyone who can
            # write the topic can replay one) must not spend their budget. A record
            # judged again (a Redis failure below, a redelivery) takes another token:
            # taking it before the write is what keeps concurrent decisions in bound.
            within, _ = self.aborts.fail(key.key_id, self._clock.monotonic())
            if not within:
                return _DeadLetter(
                    DecodeError("too_many_aborts", "too many aborts for this key"),
                    sample="too_many_aborts",
                )
            # Set here, not when applying: a Redis failure then retries the record like
            # a failed key lookup does. The marker is idempotent.
            await self._pipeline.abort(
                principal.tenant, request.request_id, request.deadline_at, request.cause
            )
            return _Aborted()
        try:
            await self._replies.check(request.reply_to)
        except Undeliverable as e:
            return _DeadLetter(e)
        if isinstance(principal, Refusal):  # a retired or revoked key: it may know why
            return _Reject(request, principal)
        pipeline = self._pipeline
        user_agent = request.client.user_agent
        refusal = pipeline.check_user_agent(user_agent) if user_agent else None
        if refusal is not None:
            return _Reject(request, refusal)
        # The region is never the producer's to choose: a record's client_ip is whatever
        # it wrote (it could dodge a region's throttle, or aim one at a region). A Kafka
        # request comes from its tenant's region (the operator's, inside the policy's
        # MAC; keystore), else from none.
        region, refusal = pipeline.arrive_in(principal, principal.policy.region or "")
        if refusal is not None:
            return _Reject(request, refusal)
        span = TRACER.start("ingress.screen", root.context)
        prepared = await pipeline.prepare(request, principal, region)
        span.end()
        if isinstance(prepared, Refusal):
            return _Reject(request, prepared)
        root.set(request_id=prepared.request_id, tenant=prepared.tenant, transport="kafka")
        return _Publish(prepared, root)

    async def _bound_to(
        self, key: KeyRecord, message: InferenceRequest | AbortRequest, record: Record
    ) -> Forged | None:
        """What a record signed by ``key`` may not do: speak for another key, send
        replies to a topic that is not one of its key's, or repeat another record's
        request id (a replay)."""
        if message.api_key_id != key.key_id:
            return Forged("key_mismatch")
        if isinstance(message, InferenceRequest) and not message.reply_to.startswith(
            self._topics.key_replies(key.key_id)
        ):
            return Forged("foreign_reply_to")
        position = f"{record.topic}/{record.partition}/{record.offset}"
        kind = "abort" if isinstance(message, AbortRequest) else "request"
        if not await self._pipeline.first_sighting(
            key.tenant, f"{kind}:{message.request_id}", position
        ):
            return Forged("replayed")
        return None

    async def effect(self, record: Record, decision: _Effect) -> asyncio.Future[Any] | None:
        if isinstance(decision, _Publish):
            m.REQUESTS.labels("kafka", "published").inc()
            root = decision.trace
            span = TRACER.start("ingress.publish", root.context)
            ack = await self._pipeline.publish(decision.request, span.context)
            if span.recording:

                def published(_: object) -> None:
                    span.end()
                    root.end()

                ack.add_done_callback(published)
            return ack
        if isinstance(decision, _Reject):
            m.REQUESTS.labels("kafka", "refused").inc()
            m.REFUSALS.labels("kafka", decision.refusal.code).inc()
            return await self._reject(decision.request, decision.refusal)
        if isinstance(decision, _Aborted):
            m.REQUESTS.labels("kafka", "aborted").inc()
            return None
        if decision.sample == "too_many_aborts":
            m.ABORTS_REFUSED.inc()
        if decision.sample is not None:
            within, _ = self.anonymous.fail(decision.sample, self._clock.monotonic())
            if not within:  # counted, not kept: the flood costs its sender, not us
                m.REQUESTS.labels("kafka", "dead_letter_sampled_out").inc()
                m.REFUSALS.labels("kafka", decision.error.reason).inc()
                return None
        m.REQUESTS.labels("kafka", "dead_letter").inc()
        return await self._dead_letters.queue(record, decision.error)

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
            rate_limit=refusal.rate_limit,
        )
        return await self._replies.send(request.reply_to, reply, request.request_id)
