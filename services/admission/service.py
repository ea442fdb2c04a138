"""Admission: decides each request and dispatches admitted work at the pace pools absorb.

Loops (one ``Component``):

- *intake*: one consumer, group ``<prefix>seawall.admission``, on the three priority
  topics. A record that does not decode, or whose ``reply_to`` is not an existing reply
  topic, is dead-lettered at once (no quota, no GPU for what nobody can receive). Each
  fetched batch is decided at once (``policy.screen``, then one pipelined
  round of atomic quota charges — region and tenant together, idempotent by request id
  (``quota.Charge``): a redelivered request is not charged twice — then
  ``policy.judge``): a rejection is answered immediately; an accepted request waits in
  its class's backlog. A class holding ``max_buffered_per_class`` requests has its
  partitions paused (re-applied before every fetch and after every rebalance, which
  resets pauses); the rest of its backlog waits in Kafka. Dead letters are bounded
  (``services.common.deadletters``).
- *dispatch*: each round, per destination pool, the ``PriorityScheduler`` shares the
  pool's free slots (``capacity.FleetCapacity``, the pacing rule) among the classes
  with work; the picked requests are checked for the client's abort marker in Redis,
  released through ``policy.release`` with the control state in force, and produced to
  ``llm.dispatch.<pool>`` keyed by session. Requests whose deadline passes while they
  wait get their ``expired`` reply from a periodic sweep.
- *telemetry*: every worker report (``llm.telemetry``) and completion
  (``llm.completions``), read without a group from the end of both topics, feeds the
  pacing rule and each pool's ``max_model_len``.
- *hints*: a rejection because a tenant's requests bucket is empty publishes a
  ``QuotaHint`` on ``llm.quota.hints`` (``hints``: at most about one per tenant per
  refill), so that ingress refuses the tenant's next requests itself until the bucket
  can pay again: an abusive tenant costs no Kafka hop, no Redis call and no decision
  here.
- *corrections*: ``RequestCompleted`` (``llm.completions``) read with the group
  ``<prefix>seawall.admission.completions`` (so once per fleet): the tokens reserved at
  admission (kept in Redis per request, see ``RedisKeys.reservation``) are taken and the
  tenant's bucket corrected by ``actual − reserved``. Taking the reservation
  (GET+DEL in one transaction) makes a redelivered completion correct nothing twice.
  A request refused after it was charged (expired, cancelled, breaker, revoked) has its
  tokens refunded the same way (the request count is not refunded).
- *control*: ``ControlFollower`` keeps the latest control event per key (and
  dead-letters what is not one: admission is the fleet's one group on it); a decision
  that expires falls back to the default.

No record stops a loop (``services.common.consuming``): a request whose reply cannot
be delivered (its ``reply_to`` is not an existing reply topic) is dead-lettered; one
that fails on its own account (too large to forward, say) is answered ``error``; the
broker or Redis being unavailable pauses the work in hand, which is tried again after
a backoff (a quota store that stays down falls back to the tiers' Redis-down policy).

Offsets of the priority topics are committed only once each record's effect — its
dispatch or its terminal reply or its dead letter — is acknowledged by the broker.
Records held in the backlog when partitions are revoked or the service stops are not
committed: the next owner decides them again (its quota charge is then the second one,
so a rebalance can only make admission stricter, never looser).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from aiokafka import ConsumerRebalanceListener, TopicPartition

from schemas import (
    BreakerState,
    ControlEvent,
    InferenceRequest,
    Priority,
    QuotaHint,
    QuotaOverride,
    ReasonCode,
    Tier,
)
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics, start_tail
from seawall_client.serde import COMPLETION, REQUEST, TELEMETRY, DecodeError, decode, encode
from seawall_client.topics import RedisKeys
from services.admission import metrics as m
from services.admission.bucket import QuotaDecision
from services.admission.capacity import CapacityConfig, FleetCapacity, Placement
from services.admission.dispatching import SCAVENGER, Lane, Queued, Round, forecasts, pick
from services.admission.hints import HintThrottle, clear_hint, hint_for
from services.admission.policy import (
    NO_FORECASTS,
    Accepted,
    AdmissionPolicy,
    Admit,
    PolicyConfig,
    Reply,
    Screened,
    engine_cost,
    failed,
    override_terms,
    quota_override,
    worker_share,
)
from services.admission.quota import (
    Charge,
    Charged,
    QuotaUnavailable,
    RedisQuota,
    on_redis_down,
)
from services.admission.scheduler import PriorityScheduler
from services.admission.settings import AdmissionSettings
from services.common.bus import commit_done, make_consumer, make_producer, topics_of
from services.common.consuming import ConsumerLoop, Record, observe_lag, retry_unavailable
from services.common.control import ControlFollower, ControlState
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies, TopicDirectory
from services.common.failures import Backoff, is_infrastructure
from services.common.lifecycle import Component, cancel_tasks, wait_set
from services.common.offsets import OffsetTracker
from services.common.redisclient import exists_each, make_redis

log = logging.getLogger(__name__)

_STORE_ERRORS = (redis.exceptions.RedisError, OSError)
SWEEP_INTERVAL_S = 0.25
"""How often waiting requests are checked for a passed deadline."""
MARKER_MARGIN_S = 60.0
"""A request's charge marker outlives its deadline by this much (a redelivery after the
deadline is answered ``expired`` before any charge)."""


@dataclass(slots=True)
class _Waiting(Queued):
    """An accepted request waiting for a dispatch slot."""

    tp: TopicPartition
    offset: int
    request: InferenceRequest
    source: Priority
    """The class of the topic it was read from (what pauses that topic)."""
    accepted: Accepted
    since: float
    replayed: bool = False
    """Charged by an earlier delivery: nothing is reserved or refunded again."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._admission.revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": len(assigned)})
        self._admission.apply_pauses()


class _TelemetryTail:
    """The capacity tail's handler: every report and completion feeds the pacing rule.
    What does not decode is skipped (nothing of it could count)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def decide(self, record: Record) -> None:
        now, capacity = self._admission.clock.monotonic(), self._admission.capacity
        if record.topic == self._admission.topics.completions:
            done = decode(COMPLETION, record.value)
            capacity.completed(done.worker_id, done.request_id, now, done.seq)
        else:
            capacity.observe(decode(TELEMETRY, record.value), now)

    async def effect(self, record: Record, decision: None) -> None:
        self._admission.wake()

    async def fail(self, record: Record, error: BaseException) -> None:
        return None


class _Corrections:
    """The corrections' handler: each ``RequestCompleted`` settles its reservation;
    what is not one is dead-lettered."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def decide(self, record: Record) -> None:
        event = decode(COMPLETION, record.value)
        actual = event.prompt_tokens + event.completion_tokens
        await self._admission.settle(event.tenant, event.tier, event.request_id, actual)

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        """A completion that does not decode is dead-lettered here: admission's group
        is the fleet's one reader of ``llm.completions`` that commits."""
        await self._admission._dead_letters.record(record, error)


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
                enterprise_pools=settings.enterprise_pools,
                max_tokens_cap=settings.max_tokens_cap,
                rate_limit_factor=settings.rate_limit_factor,
                breaker_retry_after_s=settings.breaker_retry_after_s,
                quota_retry_after_s=settings.quota_retry_after_s,
                scavenger_tiers=settings.scavenger_tiers,
                scavenger_wait_s=settings.scavenger_wait_s,
                scavenger_headroom=settings.scavenger_headroom,
                consistency_sample=settings.consistency_sample,
                consistency_min_similarity=settings.consistency_min_similarity,
            )
        )
        self.capacity = FleetCapacity(
            CapacityConfig(
                worker_timeout_s=settings.worker_timeout_s,
                slack=settings.pacing_slack,
                ledger_ttl_s=settings.ledger_ttl_s,
                prefill_steps=settings.pacing_prefill_steps,
                kv_fill=settings.pacing_kv_fill,
                vip_reserve=settings.vip_reserve,
            )
        )
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        self._schedulers: defaultdict[str, PriorityScheduler] = defaultdict(PriorityScheduler)
        """Per pool: the configured ones, and canary pools as a split names them."""
        self._queues: defaultdict[tuple[Lane, str], deque[_Waiting]] = defaultdict(deque)
        self._buffered: Counter[Priority] = Counter()
        self._class_of = {self.topics.requests(p): p for p in Priority}
        self._producer = make_producer(settings)
        self._dead_letters = DeadLetters(
            self._producer, self.topics.deadletter, f"admission:{settings.instance_id}", clock
        )
        self._replies = Replies(
            self._producer, self.topics, TopicDirectory(self._producer, clock=clock)
        )
        self._follower = ControlFollower(
            settings,
            self.topics.control,
            self.control,
            self._on_control,
            on_expire=self._on_control,
            dead_letters=self._dead_letters,
        )
        self._redis = make_redis(settings)
        self._quota = RedisQuota(self._redis, settings.redis_prefix)
        prefix = settings.topic_prefix
        self._consumer = make_consumer(settings, group_id=f"{prefix}seawall.admission")
        self._consumer.subscribe(list(self._class_of), listener=_Rebalance(self))
        self._telemetry = make_consumer(settings, group_id=None)
        self._completions = make_consumer(
            settings,
            self.topics.completions,
            group_id=f"{prefix}seawall.admission.completions",
            auto_offset_reset="latest",
        )
        self._tail: ConsumerLoop[None] = ConsumerLoop(
            self._telemetry,
            _TelemetryTail(self),
            None,
            name="admission-telemetry",
            commit=False,
            concurrency=1,
            start_consumer=False,
        )
        self._corrections: ConsumerLoop[None] = ConsumerLoop(
            self._completions,
            _Corrections(self),
            None,
            name="admission-corrections",
            commit=True,
            concurrency=settings.redis_fanout,
            fetch_timeout_ms=500,
            start_consumer=False,
        )
        self._backoff = Backoff()
        self._wake = asyncio.Event()
        self._loops: set[asyncio.Task[Any]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()
        self._last_sweep = 0.0
        self._breakers: dict[str, tuple[str, int]] = {}
        self._hints = HintThrottle()
        self._overrides: dict[str, tuple[float | None, ...]] = {}
        """Tenant → the terms of its override in force (see ``_quota_changed``)."""

    # -- lifecycle -------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.settings
        await ensure_topics(s.kafka_bootstrap, self.topics.specs(), s.topic_replication)
        await self._producer.start()
        # Group joins take seconds on some brokers (Tansu delays the first JoinGroup):
        # join both groups at once.
        await asyncio.gather(
            self._follower.start(),
            start_tail(self._telemetry, self.topics.telemetry, self.topics.completions),
            self._completions.start(),
            self._consumer.start(),
        )
        await self._tail.start()
        await self._corrections.start()
        self._loops = {
            self.spawn(self._intake_loop(), "intake"),
            self.spawn(self._dispatch_loop(), "dispatch"),
            self.spawn(self._commit_loop(), "commit"),
            *(self.spawn(self._watch(part), f"watch:{part.name}") for part in self._parts),
        }
        log.info("admission running", extra={"pools": ",".join(s.pools)})

    @property
    def _parts(self) -> tuple[Component, ...]:
        return (self._follower, self._tail, self._corrections)

    @staticmethod
    async def _watch(part: Component) -> None:
        """Fail with a part: the process exits and its supervisor restarts it."""
        await part.failed.wait()
        raise RuntimeError(f"{part.name} failed") from part.failure

    async def on_stop(self) -> None:
        await cancel_tasks(self._loops)
        waiting = [w for dq in self._queues.values() for w in dq]
        self._queues.clear()
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=self.settings.shutdown_grace_s)
        try:
            # Not committed: the next owner decides them again; give back their tokens.
            with contextlib.suppress(*_STORE_ERRORS):
                await asyncio.gather(*(self._settle_refund(w) for w in waiting))
            await self.commit_done()
        finally:
            for part in self._parts:
                await part.stop()
            for consumer in (self._consumer, self._completions, self._telemetry):
                await close(consumer)
            await close(self._producer)
            await self._redis.aclose()

    def wake(self) -> None:
        """Ask for a dispatch round now (capacity or control changed)."""
        self._wake.set()

    # -- control -------------------------------------------------------------------
    def _on_control(self, event: ControlEvent) -> None:
        """A decision changed or expired: apply what is in force now for its scope."""
        if isinstance(event, QuotaOverride):
            self._quota_changed(event.tenant)
        if isinstance(event, BreakerState):
            kind, _, name = event.scope.partition(":")
            current = self.control.get(BreakerState, event.scope)
            if kind == "worker":
                share = (
                    1.0
                    if current is None
                    else worker_share(current, self.settings.rate_limit_factor)
                )
                self.capacity.share(name, share)
            else:
                state = ("closed", 0) if current is None else (current.state, int(current.level))
                if self._breakers.get(event.scope, ("closed", 0)) != state:
                    # Level 1 of the matrix is "log only": this is that log (once per
                    # change, not per re-publication).
                    self._breakers[event.scope] = state
                    log.warning(
                        "pool breaker changed",
                        extra={"scope": event.scope, "state": state[0], "breaker_level": state[1]},
                    )
        self.wake()

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
            batches = await retry_unavailable(
                functools.partial(
                    consumer.getmany, timeout_ms=100, max_records=self.settings.intake_batch
                ),
                self._backoff,
                "admission-intake",
            )
            observe_lag("admission", consumer, batches)
            decoded: list[tuple[TopicPartition, Record, InferenceRequest, Priority]] = []
            for tp, records in batches.items():
                cls = self._class_of[tp.topic]
                for record in records:
                    self.offsets.track(tp, record.offset)
                    try:
                        decoded.append((tp, record, decode(REQUEST, record.value), cls))
                    except DecodeError as e:
                        self._refuse(tp, record, None, cls, e)
            # One look at the broker's topics for the whole batch: nobody could receive
            # an answer on a reply topic that does not exist (no quota, no GPU for it).
            unusable = await retry_unavailable(
                functools.partial(self._replies.check_many, (r.reply_to for *_, r, _ in decoded)),
                self._backoff,
                "admission-intake",
            )
            items: list[tuple[TopicPartition, int, InferenceRequest, Priority]] = []
            for tp, record, request, cls in decoded:
                error = unusable[request.reply_to]
                if error is None:
                    items.append((tp, record.offset, request, cls))
                else:
                    self._refuse(tp, record, request, cls, error)
            if items:
                await self._decide(items)

    def _refuse(
        self,
        tp: TopicPartition,
        record: Record,
        request: InferenceRequest | None,
        cls: Priority,
        error: DecodeError,
    ) -> None:
        """Dead-letter a record (``request``: ``None`` when it did not decode)."""
        m.decided("dead_letter", error.reason, cls, request)
        self._finish(self._dead_letter(tp, record, error))

    async def _decide(
        self, items: Sequence[tuple[TopicPartition, int, InferenceRequest, Priority]]
    ) -> None:
        now = self.clock.time()
        mono = self.clock.monotonic()
        lens = self.capacity.model_lens(mono)
        ahead = (
            forecasts(self._queues, self._pools(), self.capacity, mono)
            if self.settings.early_rejection
            else NO_FORECASTS
        )
        screened: list[tuple[TopicPartition, int, InferenceRequest, Priority, Screened]] = []
        for tp, offset, request, cls in items:
            try:
                verdict = self.policy.screen(request, cls, self.control, now, lens, ahead)
            except Exception as e:  # a record-level failure: it is answered, nothing stops
                self._fail(tp, offset, request, cls, e)
                continue
            if isinstance(verdict, Reply):
                self._reply(tp, offset, request, cls, verdict)
            else:
                screened.append((tp, offset, request, cls, verdict))
        if not screened:
            return
        charged = await self._charge([self._charge_of(r, s, now) for _, _, r, _, s in screened])
        now = self.clock.time()
        accepted: list[_Waiting] = []
        for i, (tp, offset, request, cls, s) in enumerate(screened):
            if charged is None:  # Redis down: the tier's policy; no region check
                c = Charged(
                    on_redis_down(s.tenant.config.tier, self.settings.quota_retry_after_s), None
                )
            else:
                c = charged[i]
            try:
                judged = self.policy.judge(request, cls, s, now, c.tenant, c.region)
            except Exception as e:
                self._fail(tp, offset, request, cls, e)
                continue
            if isinstance(judged, Reply):
                self._reply(tp, offset, request, cls, judged)
                await self._hint(request.tenant, c.tenant)
            else:
                accepted.append(
                    _Waiting(tp, offset, request, cls, judged, self.clock.monotonic(), c.replayed)
                )
        for w in accepted:
            self._queues[(w.lane, w.accepted.pool)].append(w)
            self._buffered[w.source] += 1
        self.wake()

    def _quota_changed(self, tenant: str) -> None:
        """A tenant's override came, went or changed (not a mere re-publication):
        ingress drops the tenant's hint, which may no longer hold."""
        current = quota_override(self.control, tenant, self.clock.time())
        terms = None if current is None else override_terms(current)
        if self._overrides.get(tenant) == terms:
            return
        if terms is None:
            self._overrides.pop(tenant, None)
        else:
            self._overrides[tenant] = terms
        self._hints.forget(tenant)
        self._finish(self._send_hint(clear_hint(tenant, self.clock.time())))

    async def _send_hint(self, hint: QuotaHint) -> bool:
        """Queue a hint (not awaited for its ack; skipped while the broker is
        unavailable: a lost hint only sends the tenant's next requests here)."""
        try:
            await self._producer.send(
                self.topics.quota_hints, encode(hint), key=hint.tenant.encode()
            )
        except Exception as e:
            if not is_infrastructure(e):
                raise
            return False
        m.QUOTA_HINTS.inc()
        return True

    async def _hint(self, tenant: str, decision: QuotaDecision) -> None:
        """Tell ingress when a tenant's requests bucket is empty (``hints``); not
        awaited for its ack, and skipped while the broker is unavailable: a lost hint
        only sends the tenant's next requests here."""
        hint = hint_for(tenant, decision)
        if hint is not None and self._hints.admit(hint):
            await self._send_hint(hint)

    def _charge_of(self, request: InferenceRequest, screened: Screened, now: float) -> Charge:
        """The request's charge, with its marker (kept past its deadline, plus a margin)
        and its reservation record."""
        if request.deadline_at is not None:
            life_s = max(0.0, request.deadline_at - now) + MARKER_MARGIN_S
        else:
            life_s = self.settings.reservation_ttl_s
        tenant, rid = request.tenant, request.request_id
        return Charge(
            screened.tenant,
            screened.region,
            self.keys.admitted(tenant, rid),
            int(life_s * 1000),
            self.keys.reservation(tenant, rid),
            int(self.settings.reservation_ttl_s * 1000),
        )

    async def _charge(self, charges: list[Charge]) -> list[Charged] | None:
        """One pipelined round of quota charges; ``None`` when Redis is unreachable."""
        started = self.clock.monotonic()
        try:
            charged = await self._quota.charge_many(charges)
        except QuotaUnavailable as e:
            m.QUOTA_STORE_ERRORS.labels("decide").inc()
            log.warning("quota store unavailable; per-tier policy applies", extra={"error": str(e)})
            return None
        finally:
            m.QUOTA_LATENCY.observe(self.clock.monotonic() - started)
        if log.isEnabledFor(logging.DEBUG):
            for charge, c in zip(charges, charged, strict=True):
                log.debug(
                    "quota decided",
                    extra={
                        "bucket": charge.tenant.tenant,
                        "outcome": c.tenant.outcome,
                        "reason": c.tenant.reason,
                        "replayed": c.replayed,
                        "server_time": c.tenant.at,
                    },
                )
        return charged

    # -- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await wait_set(self._wake, self.settings.dispatch_interval_s)
            self._wake.clear()
            if await self._dispatch_round():
                self._backoff.reset()
            else:
                await self._backoff.wait()  # the broker did not take the dispatches

    async def _dispatch_round(self) -> bool:
        """One round; ``False`` if the broker was unavailable (the requests wait)."""
        now = self.clock.monotonic()
        ok = True
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            ok = await self._release(self._take_expired(self.clock.time()))
        chosen = self._pick(now)
        for w in chosen.shed:
            self._reply(
                w.tp,
                w.offset,
                w.request,
                w.source,
                self.policy.shed(w.request, w.accepted, self.clock.time()),
            )
        ok = await self._release(chosen.picked, chosen.placements) and ok
        for cls in Priority:
            m.BACKLOG.labels(cls.value).set(self.backlog(cls))
        m.BACKLOG.labels(SCAVENGER).set(
            sum(len(dq) for (lane, _), dq in self._queues.items() if lane == SCAVENGER)
        )
        return ok

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

    def _pools(self) -> tuple[str, ...]:
        """The pools dispatched to: configured, split to by a canary release, or still
        holding queued work (a split that ended leaves its canary's queue to drain)."""
        pools = self.policy.pools(self.control)
        queued = {pool for (_, pool), dq in self._queues.items() if dq and pool not in pools}
        return (*pools, *sorted(queued))

    def _pick(self, now: float) -> Round[_Waiting]:
        """The requests to release now (``dispatching.pick``): per destination pool,
        what its budget holds shared by the scheduler; every request of a pool whose
        breaker refuses (to be answered); the scavenger lane's to serve or shed."""
        chosen = pick(
            self._queues,
            self._pools(),
            self.policy,
            self.control,
            self.capacity,
            self._schedulers,
            now,
        )
        for pool, view in chosen.views.items():
            m.POOL_FREE.labels(pool).set(view.free)
            m.POOL_SLOTS.labels(pool).set(view.slots)
            m.POOL_TOKENS.labels(pool, "kv", "budget").set(view.kv_budget)
            m.POOL_TOKENS.labels(pool, "kv", "in_pool").set(view.kv_in_pool)
            m.POOL_TOKENS.labels(pool, "prefill", "budget").set(view.prefill_budget)
            m.POOL_TOKENS.labels(pool, "prefill", "in_pool").set(view.prefill_in_pool)
        self._unbuffer(chosen.picked)
        self._unbuffer(chosen.shed)
        return chosen

    def _unbuffer(self, taken: Iterable[_Waiting]) -> None:
        for w in taken:
            self._buffered[w.source] -= 1

    def _requeue(self, waiting: list[_Waiting]) -> None:
        """Put requests the broker did not take back at the head of their backlogs."""
        for w in reversed(waiting):
            self._queues[(w.lane, w.accepted.pool)].appendleft(w)
            self._buffered[w.source] += 1

    async def _release(
        self, picked: list[_Waiting], placements: Sequence[Placement | None] = ()
    ) -> bool:
        """Answer or dispatch each picked request, on the partition of its placement
        where it has one, else by its key; ``False`` if the broker was unavailable (what
        it did not take is back in its backlog)."""
        if not picked:
            return True
        placed = list(placements) or [None] * len(picked)
        cancelled = await self._cancelled([w.request for w in picked])
        now, mono = self.clock.time(), self.clock.monotonic()
        lens = self.capacity.model_lens(mono)
        sends: list[tuple[_Waiting, Admit, asyncio.Future[Any]]] = []
        unsent: list[_Waiting] = []
        for w, gone, placement in zip(picked, cancelled, placed, strict=True):
            try:
                verdict = self.policy.release(
                    w.request, w.accepted.cls, w.accepted, self.control, now, gone, lens
                )
            except Exception as e:
                self._fail_waiting(w, e)
                continue
            if isinstance(verdict, Reply):
                self._reply(w.tp, w.offset, w.request, w.source, verdict)
                self._refund(w)
                continue
            d = verdict.dispatch
            if placement is not None and placement.pool != d.pool:
                placement = None  # released to another pool than the round placed it on
            try:
                future = await self._producer.send(
                    self.topics.dispatch(d.pool),
                    encode(d),
                    key=w.key.encode(),
                    partition=placement.partition if placement is not None else None,
                )
            except Exception as e:
                if is_infrastructure(e):
                    unsent.append(w)
                else:
                    self._fail_waiting(w, e)
                continue
            self.capacity.dispatched(
                d.pool,
                w.request.request_id,
                mono,
                engine_cost(w.cost, d.degradation),
                placement.worker_id if placement is not None else None,
            )
            sends.append((w, verdict, future))
        acks = await asyncio.gather(*(f for *_, f in sends), return_exceptions=True)
        for (w, admit, _), ack in zip(sends, acks, strict=True):
            if isinstance(ack, Exception):
                if is_infrastructure(ack):
                    unsent.append(w)
                else:
                    self._fail_waiting(w, ack)
                continue
            if isinstance(ack, BaseException):
                raise ack
            self.offsets.done(w.tp, w.offset)
            outcome = "admitted" if admit.reason is ReasonCode.NONE else "degraded"
            m.decided(outcome, admit.reason.value, w.source, w.request)
            m.DISPATCHES.labels(admit.dispatch.pool, w.accepted.cls.value).inc()
        if unsent:
            log.warning(
                "the broker did not take dispatches; they wait", extra={"requests": len(unsent)}
            )
            self._requeue(unsent)
        return not unsent

    async def _cancelled(self, requests: list[InferenceRequest]) -> list[bool]:
        """Which requests carry their client's abort marker (none, if Redis is down)."""
        try:
            return await exists_each(
                self._redis, [self.keys.abort(r.tenant, r.request_id) for r in requests]
            )
        except _STORE_ERRORS as e:
            m.QUOTA_STORE_ERRORS.labels("abort_check").inc()
            log.warning("could not check abort markers", extra={"error": str(e)})
            return [False] * len(requests)

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
        m.decided(reply.status.value, reply.reason.value, cls, request)
        self._finish(self._send_reply(tp, offset, request, verdict))

    def _fail(
        self,
        tp: TopicPartition,
        offset: int,
        request: InferenceRequest,
        cls: Priority,
        error: BaseException,
    ) -> None:
        """A request whose processing failed on its own account: answered ``error``."""
        code, message = failure_of(error)
        log.error(
            "a request failed on its own account",
            extra={"request_id": request.request_id, "error": type(error).__name__},
        )
        self._reply(tp, offset, request, cls, failed(request, code, message, self.clock.time()))

    def _fail_waiting(self, w: _Waiting, error: BaseException) -> None:
        self._fail(w.tp, w.offset, w.request, w.source, error)
        self._refund(w)

    def _refund(self, w: _Waiting) -> None:
        if w.accepted.reserved_tokens > 0 and not w.replayed:
            self._finish(self._settle_refund(w))

    async def _send_reply(
        self, tp: TopicPartition, offset: int, request: InferenceRequest, verdict: Reply
    ) -> None:
        async def deliver() -> None:
            await (await self._replies.send(request.reply_to, verdict.reply, request.request_id))

        try:
            await retry_unavailable(deliver, Backoff(), "admission-reply")
        except Exception as e:  # undeliverable (no such reply topic), or another of its own
            reason, message = failure_of(e)
            await self._dead_letters.send(
                source_topic=tp.topic,
                partition=tp.partition,
                offset=offset,
                key=request.partition_key.encode(),
                value=encode(request),
                reason=reason,
                error=message,
            )
        self.offsets.done(tp, offset)

    async def _dead_letter(self, tp: TopicPartition, record: Record, error: DecodeError) -> None:
        await self._dead_letters.record(record, error)
        self.offsets.done(tp, record.offset)

    # -- corrections -----------------------------------------------------------------
    async def _settle_refund(self, w: _Waiting) -> None:
        try:
            await self.settle(w.request.tenant, w.request.tier, w.request.request_id, 0)
        except (QuotaUnavailable, *_STORE_ERRORS) as e:
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token refund lost", extra={"error": str(e)})

    async def settle(self, tenant: str, tier: Tier, request_id: str, actual: float) -> None:
        """Take a request's reservation and correct its tenant's tokens bucket. Raises
        when Redis is unavailable (the corrections loop tries again)."""
        key = self.keys.reservation(tenant, request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.delete(key)
            reserved, _ = await pipe.execute()
        if reserved is None:
            m.CORRECTIONS.labels("not_found").inc()
            return
        config = self.policy.tenant_config(tenant, tier, self.control, self.clock.time())
        try:
            await self._quota.adjust(tenant, config or self.tiers[tier], actual - float(reserved))
        except QuotaUnavailable as e:
            # The reservation is taken: trying again would find nothing to correct.
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
            self._refund(w)
