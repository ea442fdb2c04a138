"""Admission's intake loop: every request read, decided and charged, or answered.

One consumer, group ``<prefix>seawall.admission``, on the three priority topics. A
record that does not decode, or whose ``reply_to`` is not an existing reply topic, is
dead-lettered at once (no quota, no GPU for what nobody can receive). Each fetched
batch is decided together: ``AdmissionPolicy.screen``, then one pipelined round of
atomic quota charges — region and tenant together, idempotent by request id
(``quota.Charge``): a redelivered request is not charged twice — then
``AdmissionPolicy.judge``: a rejection is answered immediately; an accepted request
waits in its class's backlog. The next batch is read and screened while Redis answers
(at most ``CHARGES_IN_FLIGHT`` batches' charges at once), and batches are judged in the
order read. A class holding ``max_buffered_per_class`` requests has its partitions
paused (re-applied before every fetch and after every rebalance, which resets pauses);
the rest of its backlog waits in Kafka.

Offsets of the priority topics are committed only once each record's effect — its
dispatch or its terminal reply or its dead letter — is acknowledged by the broker.
Records held in the backlog, or with their charges in flight, when partitions are
revoked or the service stops are not committed: the next owner decides them again, and
its charge replays the first one (nothing paid twice; the reservation made then waits
for the request's completion, ``corrections``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from schemas import InferenceRequest, Priority
from seawall_client import tracecontext
from seawall_client.clock import Clock
from seawall_client.serde import REQUEST, DecodeError, decode
from seawall_client.topics import RedisKeys, Topics
from seawall_client.tracecontext import TraceContext
from services.admission import metrics as m
from services.admission.answers import Answers
from services.admission.backlog import Backlog, Waiting
from services.admission.corrections import Corrections
from services.admission.hint_publisher import HintPublisher
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.charges import Charge, Charged
from services.admission.policy.decisions import NO_FORECASTS, AdmissionPolicy
from services.admission.policy.dispatching import forecasts
from services.admission.policy.outcomes import Reply, Screened
from services.admission.quota import QuotaUnavailable, RedisQuota, on_redis_down
from services.admission.settings import AdmissionSettings
from services.admission.tracing import TRACER
from services.common.bus import commit_done
from services.common.consuming import Record, observe_lag, retry_unavailable
from services.common.control_state import ControlState
from services.common.delivery import Replies
from services.common.failures import Backoff
from services.common.hop_signing import hop_key_for, lacks_mac
from services.common.lifecycle import cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.tracing import now_ns, produced_at_ns

log = logging.getLogger(__name__)

Item: TypeAlias = tuple[TopicPartition, int, InferenceRequest, bytes, Priority, TraceContext | None]
"""A request read: its partition, offset, request (decoded, and as its record carried
it), class and trace (the span its record names, where traced)."""
ScreenedItem: TypeAlias = tuple[
    TopicPartition, int, InferenceRequest, bytes, Priority, TraceContext | None, Screened
]
"""A request read and screened, with what it is to be charged."""

CHARGES_IN_FLIGHT = 2
"""Batches whose quota charges may be with Redis at once; past that, reading waits for
the oldest. With one, reading waited for every round's answer (7 ms p50 at 6,700
requests/s), and at half of admission's rate the intake ran near its own limit: p99
through admission 370 ms at 6,500 requests/s, 190-280 ms with two
(``bench/admission_throughput.py``)."""


@dataclass(frozen=True, slots=True)
class _Charging:
    """A screened batch whose charges are with Redis (``None``: Redis unreachable)."""

    screened: list[ScreenedItem]
    charged: asyncio.Task[list[Charged] | Exception | None]
    sent_ns: int
    """When the charges were sent (for the traced requests' ``admission.charge``)."""


MARKER_MARGIN_S = 60.0
"""A request's charge marker outlives its deadline by this much (a redelivery after the
deadline is answered ``expired`` before any charge)."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, intake: Intake) -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._intake.revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": len(assigned)})
        self._intake.apply_pauses()


class Intake:
    """Reads the priority topics (it subscribes ``consumer`` to them), decides each
    batch, and commits what is done."""

    def __init__(
        self,
        *,
        settings: AdmissionSettings,
        consumer: AIOKafkaConsumer,
        topics: Topics,
        keys: RedisKeys,
        offsets: OffsetTracker[TopicPartition],
        replies: Replies,
        quota: RedisQuota,
        policy: AdmissionPolicy,
        control: ControlState,
        capacity: FleetCapacity,
        backlog: Backlog,
        answers: Answers,
        corrections: Corrections,
        hints: HintPublisher,
        backoff: Backoff,
        wake: Callable[[], None],
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._consumer = consumer
        self._keys = keys
        self._offsets = offsets
        self._replies = replies
        self._quota = quota
        self._policy = policy
        self._control = control
        self._capacity = capacity
        self._backlog = backlog
        self._answers = answers
        self._corrections = corrections
        self._hints = hints
        self._backoff = backoff
        self._wake = wake
        self._clock = clock
        self._class_of = {topics.requests(p): p for p in Priority}
        self._hop = hop_key_for(settings, "requests")
        """Checks that what is read was put there by ingress (``hop_signing``)."""
        consumer.subscribe(list(self._class_of), listener=_Rebalance(self))

    def apply_pauses(self) -> None:
        """Pause the partitions of every class whose backlog is full, resume the rest."""
        buffered = self._backlog.buffered
        full = {c for c in Priority if buffered[c] >= self._settings.max_buffered_per_class}
        assigned = self._consumer.assignment()
        pause = [tp for tp in assigned if self._class_of[tp.topic] in full]
        self._consumer.pause(*pause)
        self._consumer.resume(*(tp for tp in assigned if tp not in pause))

    async def loop(self) -> None:
        """Read, screen and send each batch's charges, and judge the batches whose charges
        have come back, in the order read: up to ``CHARGES_IN_FLIGHT`` batches' charges
        travel at once, and the next read waits beside them, so that a batch is judged as
        soon as its charges are back and the next is read as soon as it is fetched."""
        consumer = self._consumer
        charging: deque[_Charging] = deque()
        reading: asyncio.Task[list[Item]] | None = None
        try:
            while True:
                if reading is None and len(charging) < CHARGES_IN_FLIGHT:
                    reading = asyncio.create_task(self._read(consumer))
                waits: set[asyncio.Future[Any]] = set()
                if reading is not None:
                    waits.add(reading)
                if charging:
                    waits.add(charging[0].charged)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                while charging and charging[0].charged.done():
                    await self._judge(charging.popleft())
                if reading is not None and reading.done():
                    read, reading = reading.result(), None
                    started = self._screen(read) if read else None
                    if started is not None:
                        charging.append(started)
        finally:
            tasks: set[asyncio.Task[Any]] = {c.charged for c in charging}
            if reading is not None:
                tasks.add(reading)
            await cancel_tasks(tasks)

    async def _read(self, consumer: AIOKafkaConsumer) -> list[Item]:
        """The next batch (waiting up to 100 ms for one), decoded, less what is answered at
        once."""
        self.apply_pauses()
        batches = await retry_unavailable(
            functools.partial(
                consumer.getmany,
                timeout_ms=100,
                max_records=self._settings.intake_batch,
            ),
            self._backoff,
            "admission-intake",
        )
        observe_lag("admission", consumer, batches)
        decoded: list[
            tuple[TopicPartition, Record, InferenceRequest, Priority, TraceContext | None]
        ] = []
        read_ns = now_ns()
        for tp, records in batches.items():
            cls = self._class_of[tp.topic]
            for record in records:
                self._offsets.track(tp, record.offset)
                if lacks_mac(self._hop, tp.topic, record.value, record.headers):
                    self._offsets.done(tp, record.offset)  # no request: nobody to answer
                    continue
                try:
                    request = decode(REQUEST, record.value)
                except DecodeError as e:
                    self._answers.refuse(tp, record, None, cls, e)
                    continue
                trace = tracecontext.from_headers(record.headers)
                TRACER.record(
                    "admission.read",
                    trace,
                    produced_at_ns(record),
                    read_ns,
                    request_id=request.request_id,
                )
                decoded.append((tp, record, request, cls, trace))
        # One look at the broker's topics for the whole batch: nobody could receive an
        # answer on a reply topic that does not exist (no quota, no GPU for it).
        unusable = await retry_unavailable(
            functools.partial(self._replies.check_many, (d[2].reply_to for d in decoded)),
            self._backoff,
            "admission-intake",
        )
        items: list[Item] = []
        for tp, record, request, cls, trace in decoded:
            error = unusable[request.reply_to]
            if error is None:
                items.append((tp, record.offset, request, record.value, cls, trace))
            else:
                self._answers.refuse(tp, record, request, cls, error)
        return items

    def _screen(self, items: Sequence[Item]) -> _Charging | None:
        """Screen a batch (a refusal answered at once) and send the charges of the rest;
        ``None``: nothing left to charge."""
        now = self._clock.time()
        mono = self._clock.monotonic()
        lens = self._capacity.model_lens(mono)
        ahead = (
            forecasts(
                self._backlog.queues,
                self._backlog.pools(self._policy.pools(self._control)),
                self._capacity,
                mono,
            )
            if self._settings.early_rejection
            else NO_FORECASTS
        )
        screened: list[ScreenedItem] = []
        for tp, offset, request, value, cls, trace in items:
            try:
                verdict = self._policy.screen(request, cls, self._control, now, lens, ahead)
            except Exception as e:  # a record-level failure: it is answered, nothing stops
                self._answers.fail(tp, offset, request, cls, e)
                continue
            if isinstance(verdict, Reply):
                self._answers.reply(tp, offset, request, cls, verdict)
            else:
                screened.append((tp, offset, request, value, cls, trace, verdict))
        if not screened:
            return None
        charges = [self._charge_of(r, s, now) for _, _, r, _, _, _, s in screened]
        return _Charging(screened, asyncio.create_task(self._charge(charges)), now_ns())

    async def _judge(self, charging: _Charging) -> None:
        """Judge a batch on its charges' outcomes: a refusal answered, the rest waits in
        its class's backlog."""
        screened = charging.screened
        charged = await charging.charged
        now = self._clock.time()
        judged_ns = now_ns()
        accepted: list[Waiting] = []
        for i, (tp, offset, request, value, cls, trace, s) in enumerate(screened):
            if trace is not None:
                TRACER.record("admission.charge", trace, charging.sent_ns, judged_ns)
            if isinstance(charged, Exception):  # the call itself was wrong: each answered
                self._answers.fail(tp, offset, request, cls, charged)
                continue
            if charged is None:  # Redis down: the tier's policy; no region check
                c = Charged(
                    on_redis_down(s.tenant.config.tier, self._settings.quota_retry_after_s), None
                )
            else:
                c = charged[i]
            try:
                judged = self._policy.judge(request, cls, s, now, c.tenant, c.region)
            except Exception as e:
                self._answers.fail(tp, offset, request, cls, e)
                continue
            if isinstance(judged, Reply):
                self._answers.reply(tp, offset, request, cls, judged)
                await self._hints.hint(request.tenant, c.tenant)
            else:
                accepted.append(
                    Waiting(
                        tp,
                        offset,
                        request,
                        value,
                        cls,
                        judged,
                        self._clock.monotonic(),
                        trace,
                        judged_ns,
                    )
                )
        self._backlog.add(accepted)
        self._wake()

    def _charge_of(self, request: InferenceRequest, screened: Screened, now: float) -> Charge:
        """The request's charge, with its marker (kept past its deadline, plus a margin)
        and its reservation record."""
        if request.deadline_at is not None:
            life_s = max(0.0, request.deadline_at - now) + MARKER_MARGIN_S
        else:
            life_s = self._settings.reservation_ttl_s
        tenant, rid = request.tenant, request.request_id
        return Charge(
            screened.tenant,
            screened.region,
            self._keys.admitted(tenant, rid),
            int(life_s * 1000),
            self._keys.reservation(tenant, rid),
            int(self._settings.reservation_ttl_s * 1000),
        )

    async def _charge(self, charges: list[Charge]) -> list[Charged] | Exception | None:
        """One pipelined round of quota charges; ``None`` when Redis is unreachable (each
        tier's fallback applies); the error when Redis refused the call itself (each of
        its requests is answered with it: never a reason for the loop to stop)."""
        started = self._clock.monotonic()
        try:
            charged = await self._quota.charge_many(charges)
        except QuotaUnavailable as e:
            m.QUOTA_STORE_ERRORS.labels("decide").inc()
            log.warning("quota store unavailable; per-tier policy applies", extra={"error": str(e)})
            return None
        except Exception as e:
            m.QUOTA_STORE_ERRORS.labels("refused").inc()
            log.error("the quota store refused the charges", extra={"error": repr(e)[:300]})
            return e
        finally:
            m.QUOTA_LATENCY.observe(self._clock.monotonic() - started)
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

    # -- commits and rebalances -----------------------------------------------------------
    async def commit_done(self) -> None:
        await commit_done(self._consumer, self._offsets)

    async def commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.commit_interval_s)
            await self.commit_done()

    async def revoked(self, revoked: list[TopicPartition]) -> None:
        """Partitions taken away: commit what is done, drop what waits. Its new owner
        decides it again, replaying its charge: its tokens stay reserved for it
        (``corrections``)."""
        await self.commit_done()
        self._offsets.forget(revoked)
        gone = set(revoked)
        self._backlog.remove(lambda w: w.tp in gone)
