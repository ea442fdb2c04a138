"""Admission: decides each request and dispatches admitted work at the pace pools absorb.

Loops (one ``Component``):

- *intake*: one consumer, group ``<prefix>seawall.admission``, on the three priority
  topics. Each fetched batch is decided at once (``policy.screen``, then one pipelined
  round of quota decisions, ``policy.judge``): a rejection is answered immediately;
  an accepted request waits in its class's backlog. A class holding
  ``max_buffered_per_class`` requests has its partitions paused (re-applied before every
  fetch and after every rebalance, which resets pauses); the rest of its backlog waits
  in Kafka. Undecodable records go to the dead-letter topic.
- *dispatch*: each round, per destination pool, the ``PriorityScheduler`` shares the
  pool's free slots (``capacity.FleetCapacity``, the pacing rule) among the classes
  with work; the picked requests are checked for the client's abort marker in Redis,
  released through ``policy.release`` with the control state in force, and produced to
  ``llm.dispatch.<pool>`` keyed by session. Requests whose deadline passes while they
  wait get their ``expired`` reply from a periodic sweep.
- *telemetry*: every worker report and completion, read without a group from the end of
  the topic, feeds the pacing rule.
- *corrections*: ``RequestCompleted`` read with the group
  ``<prefix>seawall.admission.completions`` (so once per fleet): the tokens reserved at
  admission (kept in Redis per request, see ``RedisKeys.reservation``) are taken and the
  tenant's bucket corrected by ``actual − reserved``. Taking the reservation
  (GET+DEL in one transaction) makes a redelivered completion correct nothing twice.
  A request refused after it was charged (expired, cancelled, breaker, revoked) has its
  tokens refunded the same way (the request count is not refunded).
- *control*: ``ControlFollower`` keeps the latest control event per key.

Offsets of the priority topics are committed only once each record's effect — its
dispatch or its terminal reply or its dead letter — is acknowledged by the broker.
Records held in the backlog when partitions are revoked or the service stops are not
committed: the next owner decides them again (its quota charge is then the second one,
so a rebalance can only make admission stricter, never looser).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from schemas import (
    BreakerState,
    ControlEvent,
    InferenceRequest,
    Priority,
    ReasonCode,
    RequestCompleted,
    Tier,
)
from services.admission import metrics as m
from services.admission.capacity import CapacityConfig, FleetCapacity
from services.admission.dispatching import pick
from services.admission.policy import (
    Accepted,
    AdmissionPolicy,
    Admit,
    PolicyConfig,
    Reply,
    Screened,
    worker_share,
)
from services.admission.quota import (
    QuotaDecision,
    QuotaRequest,
    QuotaUnavailable,
    RedisQuota,
    on_redis_down,
)
from services.admission.scheduler import PriorityScheduler
from services.admission.settings import AdmissionSettings
from services.common.bus import (
    commit_done,
    ensure_topics,
    make_consumer,
    make_producer,
    send_dead_letter,
    topics_of,
)
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.control import ControlFollower, ControlState
from services.common.lifecycle import Component, cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.serde import REQUEST, TELEMETRY, DecodeError, decode, encode
from services.common.topics import RedisKeys

log = logging.getLogger(__name__)

_STORE_ERRORS = (redis.exceptions.RedisError, OSError)
SWEEP_INTERVAL_S = 0.25
"""How often waiting requests are checked for a passed deadline."""


@dataclass(slots=True)
class _Waiting:
    """An accepted request waiting for a dispatch slot."""

    tp: TopicPartition
    offset: int
    request: InferenceRequest
    source: Priority
    """The class of the topic it was read from (what pauses that topic)."""
    accepted: Accepted
    since: float


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._admission.revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": len(assigned)})
        self._admission.apply_pauses()


class Admission(Component):
    name = "admission"

    def __init__(self, settings: AdmissionSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__()
        self.settings = settings
        self.clock = clock
        self.topics = topics_of(settings)
        self.keys = RedisKeys(settings.redis_prefix)
        self.tiers = settings.tier_configs()
        self.control = ControlState(clock)
        self.policy = AdmissionPolicy(
            PolicyConfig(
                tiers=self.tiers,
                pools=settings.pools,
                small_pool=settings.small_pool,
                enterprise_pool=settings.enterprise_pool,
                max_tokens_cap=settings.max_tokens_cap,
                rate_limit_factor=settings.rate_limit_factor,
                breaker_retry_after_s=settings.breaker_retry_after_s,
                quota_retry_after_s=settings.quota_retry_after_s,
            )
        )
        self.capacity = FleetCapacity(
            CapacityConfig(
                worker_timeout_s=settings.worker_timeout_s,
                slack=settings.pacing_slack,
                ledger_ttl_s=settings.ledger_ttl_s,
            )
        )
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        self._schedulers = {pool: PriorityScheduler() for pool in settings.pools}
        self._queues: defaultdict[tuple[Priority, str], deque[_Waiting]] = defaultdict(deque)
        self._buffered: Counter[Priority] = Counter()
        self._class_of = {self.topics.requests(p): p for p in Priority}
        self._follower = ControlFollower(
            settings, self.topics.control, self.control, self._on_control
        )
        self._producer = make_producer(settings)
        self._redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._quota = RedisQuota(self._redis, settings.redis_prefix)
        prefix = settings.topic_prefix
        self._consumer = make_consumer(settings, group_id=f"{prefix}seawall.admission")
        self._consumer.subscribe(list(self._class_of), listener=_Rebalance(self))
        self._telemetry = make_consumer(settings, group_id=None)
        self._completions = make_consumer(
            settings,
            self.topics.telemetry,
            group_id=f"{prefix}seawall.admission.completions",
            auto_offset_reset="latest",
        )
        self._wake = asyncio.Event()
        self._loops: set[asyncio.Task[Any]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()
        self._last_sweep = 0.0
        self._breakers: dict[str, tuple[str, int]] = {}

    # -- lifecycle -------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.settings
        await ensure_topics(s.kafka_bootstrap, self.topics.specs())
        await self._producer.start()
        # Group joins take seconds on some brokers (Tansu delays the first JoinGroup):
        # join both groups at once.
        await asyncio.gather(
            self._follower.start(),
            self._tail(self._telemetry, self.topics.telemetry),
            self._completions.start(),
            self._consumer.start(),
        )
        self._loops = {
            self.spawn(self._intake_loop(), "intake"),
            self.spawn(self._dispatch_loop(), "dispatch"),
            self.spawn(self._telemetry_loop(), "telemetry"),
            self.spawn(self._corrections_loop(), "corrections"),
            self.spawn(self._commit_loop(), "commit"),
        }
        log.info("admission running", extra={"pools": ",".join(s.pools)})

    @staticmethod
    async def _tail(consumer: AIOKafkaConsumer, topic: str) -> None:
        """Start a groupless consumer on every partition of ``topic``, from its end."""
        await consumer.start()
        await consumer.topics()  # loads the metadata: the topic's partitions
        tps = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or {0})
        ]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)  # resolved now, not at the first fetch

    async def on_stop(self) -> None:
        await cancel_tasks(self._loops)
        waiting = [w for dq in self._queues.values() for w in dq]
        self._queues.clear()
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=self.settings.shutdown_grace_s)
        try:
            # Not committed: the next owner decides them again; give back their tokens.
            await asyncio.gather(*(self._settle_refund(w) for w in waiting))
            await self.commit_done()
        finally:
            for consumer in (self._consumer, self._completions, self._telemetry):
                await consumer.stop()
            await self._follower.stop()
            await self._producer.stop()
            await self._redis.aclose()

    # -- control -------------------------------------------------------------------
    def _on_control(self, event: ControlEvent) -> None:
        if isinstance(event, BreakerState):
            kind, _, name = event.scope.partition(":")
            if kind == "worker":
                self.capacity.share(name, worker_share(event, self.settings.rate_limit_factor))
            elif self._breakers.get(event.scope) != (event.state, event.level):
                # Level 1 of the matrix is "log only": this is that log (once per change,
                # not per re-publication).
                self._breakers[event.scope] = (event.state, event.level)
                log.warning(
                    "pool breaker changed",
                    extra={
                        "scope": event.scope,
                        "state": event.state,
                        "breaker_level": int(event.level),
                    },
                )
        self._wake.set()

    # -- intake ----------------------------------------------------------------------
    def backlog(self, cls: Priority) -> int:
        """Accepted requests waiting in class ``cls``."""
        return sum(len(dq) for (c, _), dq in self._queues.items() if c is cls)

    def apply_pauses(self) -> None:
        """Pause the partitions of every class whose backlog is full, resume the rest."""
        full = {c for c in Priority if self._buffered[c] >= self.settings.max_buffered_per_class}
        assigned = self._consumer.assignment()
        pause = [tp for tp in assigned if self._class_of[tp.topic] in full]
        self._consumer.pause(*pause)
        self._consumer.resume(*(tp for tp in assigned if tp not in pause))

    async def _intake_loop(self) -> None:
        consumer = self._consumer
        while True:
            self.apply_pauses()
            batches = await consumer.getmany(timeout_ms=100, max_records=self.settings.intake_batch)
            items: list[tuple[TopicPartition, int, InferenceRequest, Priority]] = []
            for tp, records in batches.items():
                cls = self._class_of[tp.topic]
                for record in records:
                    self.offsets.track(tp, record.offset)
                    try:
                        request = decode(REQUEST, record.value)
                    except DecodeError as e:
                        m.DECISIONS.labels("dead_letter", e.reason, cls.value).inc()
                        self._finish(self._dead_letter(tp, record, e))
                    else:
                        items.append((tp, record.offset, request, cls))
            if items:
                await self._decide(items)

    async def _decide(
        self, items: Sequence[tuple[TopicPartition, int, InferenceRequest, Priority]]
    ) -> None:
        now = self.clock.time()
        screened: list[tuple[TopicPartition, int, InferenceRequest, Priority, Screened]] = []
        for tp, offset, request, cls in items:
            verdict = self.policy.screen(request, cls, self.control, now)
            if isinstance(verdict, Reply):
                self._reply(tp, offset, request, cls, verdict)
            else:
                screened.append((tp, offset, request, cls, verdict))
        if not screened:
            return
        regions = [s.region for *_, s in screened if s.region is not None]
        region_decisions = await self._charge(regions)
        # Regions first: a request its region refuses does not cost its tenant anything.
        # (If Redis is down the region check is skipped; the tier policy decides.)
        decided_regions = iter(region_decisions or ())
        region_of = [
            next(decided_regions) if s.region is not None and region_decisions else None
            for *_, s in screened
        ]
        to_charge = [i for i, r in enumerate(region_of) if r is None or r.allowed]
        tenants = [screened[i][4].tenant for i in to_charge]
        decided = await self._charge(tenants)
        if decided is None:
            decided = [
                on_redis_down(q.config.tier, self.settings.quota_retry_after_s) for q in tenants
            ]
        tenant_of = dict(zip(to_charge, decided, strict=True))
        now = self.clock.time()
        accepted: list[_Waiting] = []
        for i, (tp, offset, request, cls, s) in enumerate(screened):
            judged = self.policy.judge(request, cls, s, now, tenant_of.get(i), region_of[i])
            if isinstance(judged, Reply):
                self._reply(tp, offset, request, cls, judged)
            else:
                accepted.append(_Waiting(tp, offset, request, cls, judged, self.clock.monotonic()))
        await self._reserve(w for w in accepted if w.accepted.reserved_tokens > 0)
        for w in accepted:
            self._queues[(w.accepted.cls, w.accepted.pool)].append(w)
            self._buffered[w.source] += 1
        self._wake.set()

    async def _charge(self, items: list[QuotaRequest]) -> list[QuotaDecision] | None:
        """One pipelined round of quota decisions; ``None`` when Redis is unreachable."""
        if not items:
            return []
        started = self.clock.monotonic()
        try:
            decisions = await self._quota.decide_many(items)
        except QuotaUnavailable as e:
            m.QUOTA_STORE_ERRORS.labels("decide").inc()
            log.warning("quota store unavailable; per-tier policy applies", extra={"error": str(e)})
            return None
        finally:
            m.QUOTA_LATENCY.observe(self.clock.monotonic() - started)
        if log.isEnabledFor(logging.DEBUG):
            for item, d in zip(items, decisions, strict=True):
                log.debug(
                    "quota decided",
                    extra={
                        "bucket": item.tenant,
                        "outcome": d.outcome,
                        "reason": d.reason,
                        "server_time": d.at,
                    },
                )
        return decisions

    async def _reserve(self, waiting: Iterable[_Waiting]) -> None:
        """Remember each request's reserved tokens for its completion's correction."""
        ttl_ms = int(self.settings.reservation_ttl_s * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for w in waiting:
                    r = w.request
                    key = self.keys.reservation(r.tenant, r.request_id)
                    pipe.set(key, repr(w.accepted.reserved_tokens), px=ttl_ms)
                await pipe.execute()
        except _STORE_ERRORS as e:
            # Without the record the completion corrects nothing: the tenant stays
            # charged the full reservation (stricter, never looser).
            m.QUOTA_STORE_ERRORS.labels("reserve").inc()
            log.warning("could not record token reservations", extra={"error": str(e)})

    # -- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.dispatch_interval_s)
            self._wake.clear()
            await self._dispatch_round()

    async def _dispatch_round(self) -> None:
        now = self.clock.monotonic()
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            await self._release(self._take_expired(self.clock.time()))
        await self._release(self._pick(now))
        for cls in Priority:
            m.BACKLOG.labels(cls.value).set(self.backlog(cls))

    def _take_expired(self, now: float) -> list[_Waiting]:
        return self._remove(lambda w: w.request.expired(now))

    def _remove(self, which: Callable[[_Waiting], bool]) -> list[_Waiting]:
        """Take the waiting requests ``which`` selects out of every backlog."""
        removed: list[_Waiting] = []
        for key, dq in list(self._queues.items()):
            keep: deque[_Waiting] = deque()
            for w in dq:
                (removed if which(w) else keep).append(w)
            if len(keep) != len(dq):
                self._queues[key] = keep
        self._unbuffer(removed)
        return removed

    def _pick(self, now: float) -> list[_Waiting]:
        """The requests to release now (``dispatching.pick``): per destination pool, its
        free slots shared by the scheduler; every request of a pool whose breaker
        refuses (to be answered)."""
        picked, views = pick(
            self._queues,
            self.settings.pools,
            self.policy,
            self.control,
            self.capacity,
            self._schedulers,
            now,
        )
        for pool, view in views.items():
            m.POOL_FREE.labels(pool).set(view.free)
            m.POOL_SLOTS.labels(pool).set(view.slots)
        self._unbuffer(picked)
        return picked

    def _unbuffer(self, taken: Iterable[_Waiting]) -> None:
        for w in taken:
            self._buffered[w.source] -= 1

    async def _release(self, picked: list[_Waiting]) -> None:
        if not picked:
            return
        cancelled = await self._cancelled([w.request.request_id for w in picked])
        now, mono = self.clock.time(), self.clock.monotonic()
        sends: list[tuple[_Waiting, Admit, asyncio.Future[Any]]] = []
        for w, gone in zip(picked, cancelled, strict=True):
            verdict = self.policy.release(
                w.request, w.accepted.cls, w.accepted, self.control, now, gone
            )
            if isinstance(verdict, Reply):
                self._reply(w.tp, w.offset, w.request, w.source, verdict)
                if w.accepted.reserved_tokens > 0:
                    self._finish(self._settle_refund(w))
                continue
            d = verdict.dispatch
            future = await self._producer.send(
                self.topics.dispatch(d.pool), encode(d), key=w.request.partition_key.encode()
            )
            self.capacity.dispatched(d.pool, w.request.request_id, mono)
            sends.append((w, verdict, future))
        for w, admit, future in sends:
            await future
            self.offsets.done(w.tp, w.offset)
            outcome = "admitted" if admit.reason is ReasonCode.NONE else "degraded"
            m.DECISIONS.labels(outcome, admit.reason.value, w.source.value).inc()
            m.DISPATCHES.labels(admit.dispatch.pool, w.accepted.cls.value).inc()

    async def _cancelled(self, request_ids: list[str]) -> list[bool]:
        """Which requests carry the client's abort marker (none, if Redis is down)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.exists(self.keys.abort(rid))
                found: list[int] = await pipe.execute()
        except _STORE_ERRORS as e:
            m.QUOTA_STORE_ERRORS.labels("abort_check").inc()
            log.warning("could not check abort markers", extra={"error": str(e)})
            return [False] * len(request_ids)
        return [bool(n) for n in found]

    # -- terminal replies and dead letters ------------------------------------------------
    def _finish(self, coro: Any) -> None:
        task = self.spawn(coro, "finish")
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    def _reply(
        self,
        tp: TopicPartition,
        offset: int,
        request: InferenceRequest,
        cls: Priority,
        verdict: Reply,
    ) -> None:
        reply = verdict.reply
        m.DECISIONS.labels(reply.status.value, reply.reason.value, cls.value).inc()
        self._finish(self._send_reply(tp, offset, request, verdict))

    async def _send_reply(
        self, tp: TopicPartition, offset: int, request: InferenceRequest, verdict: Reply
    ) -> None:
        try:
            await self._producer.send_and_wait(
                request.reply_to, encode(verdict.reply), key=request.request_id.encode()
            )
        except KafkaTimeoutError:
            # The reply topic does not exist (or the broker is gone: then this fails
            # too, and the service restarts). Keep the request where an operator sees it.
            await send_dead_letter(
                self._producer,
                self.topics,
                source_topic=tp.topic,
                partition=tp.partition,
                offset=offset,
                key=request.partition_key.encode(),
                raw=encode(request),
                error=DecodeError(
                    "reply_topic_unreachable", f"could not deliver to {request.reply_to!r}"
                ),
                service=f"admission:{self.settings.instance_id}",
                clock=self.clock,
            )
        self.offsets.done(tp, offset)

    async def _dead_letter(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], error: DecodeError
    ) -> None:
        await send_dead_letter(
            self._producer,
            self.topics,
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            raw=record.value,
            error=error,
            service=f"admission:{self.settings.instance_id}",
            clock=self.clock,
        )
        self.offsets.done(tp, record.offset)

    # -- telemetry: capacity and corrections ---------------------------------------------
    async def _telemetry_loop(self) -> None:
        consumer = self._telemetry
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            now = self.clock.monotonic()
            for records in batches.values():
                for record in records:
                    self._observe(record.value, now)
            if batches:
                self._wake.set()

    def _observe(self, raw: bytes | None, now: float) -> None:
        try:
            event = decode(TELEMETRY, raw)
        except DecodeError:
            return  # the workers' records; the controller dead-letters what it cannot read
        self.capacity.observe(event, now)

    async def _corrections_loop(self) -> None:
        consumer = self._completions
        while True:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    with contextlib.suppress(DecodeError):
                        event = decode(TELEMETRY, record.value)
                        if isinstance(event, RequestCompleted):
                            actual = event.prompt_tokens + event.completion_tokens
                            await self._settle(event.tenant, event.tier, event.request_id, actual)
            if batches:
                commits = {tp: records[-1].offset + 1 for tp, records in batches.items()}
                try:
                    await consumer.commit(commits)
                except CommitFailedError as e:
                    log.warning("corrections commit failed", extra={"error": str(e)})

    async def _settle_refund(self, w: _Waiting) -> None:
        if w.accepted.reserved_tokens > 0:
            await self._settle(w.request.tenant, w.request.tier, w.request.request_id, 0)

    async def _settle(self, tenant: str, tier: Tier, request_id: str, actual: float) -> None:
        """Take a request's reservation and correct its tenant's tokens bucket."""
        key = self.keys.reservation(tenant, request_id)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(key)
                pipe.delete(key)
                reserved, _ = await pipe.execute()
            if reserved is None:
                m.CORRECTIONS.labels("not_found").inc()
                return
            config = self.policy.tenant_config(tenant, tier, self.control, self.clock.time())
            await self._quota.adjust(tenant, config or self.tiers[tier], actual - float(reserved))
        except (QuotaUnavailable, *_STORE_ERRORS) as e:
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token correction lost", extra={"error": str(e)})
            return
        m.CORRECTIONS.labels("corrected" if actual else "refunded").inc()

    # -- commits and rebalances -----------------------------------------------------------
    async def commit_done(self) -> None:
        await commit_done(self._consumer, self.offsets)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.commit_done()

    async def revoked(self, revoked: list[TopicPartition]) -> None:
        """Partitions taken away: commit what is done, drop what waits (its new owner
        decides it again) and give back its tokens."""
        await self.commit_done()
        self.offsets.forget(revoked)
        gone = set(revoked)
        for w in self._remove(lambda w: w.tp in gone):
            self._finish(self._settle_refund(w))
