"""Admission's dispatch loop: admitted work released at the pace the pools absorb.

Each round, per destination pool, the ``PriorityScheduler`` shares the pool's free slots
(``policy.capacity.FleetCapacity``, the pacing rule) among the classes with work
(``policy.dispatching.pick``); the picked requests are checked for the client's abort marker
in Redis, released through ``AdmissionPolicy.release`` with the control state in force, and
produced to ``llm.dispatch.<pool>`` keyed by session. Requests whose deadline passes
while they wait get their ``expired`` reply from a periodic sweep. A request's offset
is done once the broker acknowledges its dispatch; what the broker did not take goes
back to the head of its backlog and waits for a backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import InferenceRequest, Priority, ReasonCode
from seawall_client import tracecontext
from seawall_client.clock import Clock
from seawall_client.serde import encode_with
from seawall_client.topics import RedisKeys, Topics
from services.admission import metrics as m
from services.admission.answers import Answers
from services.admission.backlog import Backlog, Waiting
from services.admission.corrections import STORE_ERRORS, Corrections
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.dispatching import SCAVENGER, Round, pick
from services.admission.policy.outcomes import Admit, Reply
from services.admission.policy.round_budget import Placement
from services.admission.policy.scheduler import PriorityScheduler
from services.admission.policy.sizing import engine_cost
from services.admission.tracing import TRACER
from services.common.bus import Outgoing, send_batched
from services.common.control_state import ControlState
from services.common.failures import Backoff, is_infrastructure
from services.common.hop_signing import HopKey, mac_headers
from services.common.lifecycle import cancel_tasks, wait_set
from services.common.offsets import OffsetTracker
from services.common.redisclient import exists_each
from services.common.tracing import Span, now_ns

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.25
"""How often waiting requests are checked for a passed deadline."""
GAUGES_INTERVAL_S = 1.0
"""How often the pool gauges of pools without work are refreshed (a round measures only
the pools it has work for; measuring one walks its workers)."""
ROUNDS_IN_FLIGHT = 4
"""Rounds whose acknowledgements may be outstanding at once; past that the loop waits
for the oldest (the producer's buffer stays bounded)."""
SETTLE_ON_STOP_S = 5.0
"""How long a stopping dispatch loop waits for the acknowledgements of what it sent."""


class Dispatcher:
    """Runs dispatch rounds: when woken (capacity or control changed, work accepted), or
    every ``dispatch_interval_s``."""

    def __init__(
        self,
        *,
        interval_s: float,
        backlog: Backlog,
        policy: AdmissionPolicy,
        control: ControlState,
        capacity: FleetCapacity,
        producer: AIOKafkaProducer,
        topics: Topics,
        redis: aioredis.Redis,
        keys: RedisKeys,
        offsets: OffsetTracker[TopicPartition],
        answers: Answers,
        corrections: Corrections,
        backoff: Backoff,
        clock: Clock,
        hop: HopKey | None = None,
    ) -> None:
        """``hop``: MACs what goes onto the dispatch topics (``hop_signing``)."""
        self._interval_s = interval_s
        self._hop = hop
        self._backlog = backlog
        self._policy = policy
        self._control = control
        self._capacity = capacity
        self._producer = producer
        self._topics = topics
        self._redis = redis
        self._keys = keys
        self._offsets = offsets
        self._answers = answers
        self._corrections = corrections
        self._backoff = backoff
        self._clock = clock
        self._schedulers: defaultdict[str, PriorityScheduler] = defaultdict(PriorityScheduler)
        """Per pool: the configured ones, and canary pools as a split names them."""
        self._wake = asyncio.Event()
        self._last_sweep = 0.0
        self._last_gauges = -GAUGES_INTERVAL_S

    def wake(self) -> None:
        """Ask for a dispatch round now (capacity or control changed)."""
        self._wake.set()

    async def loop(self) -> None:
        """Rounds, each released as soon as the last one is sent: a round's acknowledgements
        are awaited beside the next rounds (at most ``ROUNDS_IN_FLIGHT``), so a slow
        acknowledgement delays no dispatch behind it. A round the broker did not take in
        full makes the loop wait a backoff once its acknowledgements are in."""
        settling: deque[asyncio.Task[bool]] = deque()
        try:
            while True:
                while settling and (settling[0].done() or len(settling) >= ROUNDS_IN_FLIGHT):
                    if await settling.popleft():
                        self._backoff.reset()
                    else:
                        await self._backoff.wait()  # the broker did not take the dispatches
                # With nothing waiting, only news (a wake) or the sweep and gauges' turn
                # makes a round worth running.
                idle = self._backlog.empty
                await wait_set(self._wake, GAUGES_INTERVAL_S if idle else self._interval_s)
                self._wake.clear()
                settle = await self._round()
                if settle is not None:
                    settling.append(asyncio.ensure_future(settle))
        finally:
            # Stopping: let the broker answer what it was sent (its offsets can then be
            # committed, and the next owner does not dispatch it again), within a bound.
            if settling:
                await asyncio.wait(settling, timeout=SETTLE_ON_STOP_S)
            await cancel_tasks(set(settling))
            await asyncio.gather(*settling, return_exceptions=True)

    async def _round(self) -> Coroutine[Any, Any, bool] | None:
        """One round: its requests answered or handed to the producer; returns what
        settles their acknowledgements (``None``: nothing was sent)."""
        now = self._clock.monotonic()
        expired: list[Waiting] = []
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            expired = self._backlog.take_expired(self._clock.time())
        chosen = self._pick(now)
        for w in chosen.shed:
            self._answers.reply(
                w.tp,
                w.offset,
                w.request,
                w.source,
                self._policy.shed(w.request, w.accepted, self._clock.time()),
            )
        settle = await self._release(
            [*expired, *chosen.picked], [*([None] * len(expired)), *chosen.placements]
        )
        for cls in Priority:
            m.BACKLOG.labels(cls.value).set(self._backlog.count(cls))
        m.BACKLOG.labels(SCAVENGER).set(self._backlog.scavengers())
        return settle

    def _pick(self, now: float) -> Round[Waiting]:
        """The requests to release now (``policy.dispatching.pick``): per destination pool,
        what its budget holds shared by the scheduler; every request of a pool whose
        breaker refuses (to be answered); the scavenger lane's to serve or shed. The
        pool gauges show what the round measured, and every pool once a
        ``GAUGES_INTERVAL_S``."""
        pools = self._backlog.pools(self._policy.pools(self._control))
        chosen = pick(
            self._backlog.queues,
            pools,
            self._policy,
            self._control,
            self._capacity,
            self._schedulers,
            now,
        )
        views = chosen.views
        if now - self._last_gauges >= GAUGES_INTERVAL_S:
            self._last_gauges = now
            views = {p: views[p] if p in views else self._capacity.view(p, now) for p in pools}
        for pool, view in views.items():
            m.POOL_FREE.labels(pool).set(view.free)
            m.POOL_SLOTS.labels(pool).set(view.slots)
            m.POOL_TOKENS.labels(pool, "kv", "budget").set(view.kv_budget)
            m.POOL_TOKENS.labels(pool, "kv", "in_pool").set(view.kv_in_pool)
            m.POOL_TOKENS.labels(pool, "prefill", "budget").set(view.prefill_budget)
            m.POOL_TOKENS.labels(pool, "prefill", "in_pool").set(view.prefill_in_pool)
        self._backlog.unbuffer(chosen.picked)
        self._backlog.unbuffer(chosen.shed)
        return chosen

    async def _release(
        self, picked: list[Waiting], placements: Sequence[Placement | None]
    ) -> Coroutine[Any, Any, bool] | None:
        """Answer or dispatch each picked request, on the partition of its placement
        where it has one, else by its key. Returns what settles the dispatches once the
        broker has acknowledged them (``_settle``); ``None`` when none was sent."""
        if not picked:
            return None
        placed = list(placements)
        cancelled = await self._cancelled([w.request for w in picked])
        now, mono = self._clock.time(), self._clock.monotonic()
        lens = self._capacity.model_lens(mono)
        chosen: list[tuple[Waiting, Admit, Placement | None, Span | None]] = []
        outgoing: list[Outgoing] = []
        released_ns = now_ns()
        for w, gone, placement in zip(picked, cancelled, placed, strict=True):
            try:
                verdict = self._policy.release(
                    w.request, w.accepted.cls, w.accepted, self._control, now, gone, lens
                )
            except Exception as e:
                self._answers.fail_waiting(w, e)
                continue
            if isinstance(verdict, Reply):
                self._answers.reply(w.tp, w.offset, w.request, w.source, verdict)
                self._corrections.refund(w)
                continue
            d = verdict.dispatch
            if placement is not None and placement.pool != d.pool:
                placement = None  # released to another pool than the round placed it on
            try:
                # ``release`` dispatches the very request it was given: its bytes as read.
                value = encode_with(d, "request", w.encoded)
            except Exception as e:
                self._answers.fail_waiting(w, e)
                continue
            partition = placement.partition if placement is not None else None
            span = None
            if w.trace is not None:
                TRACER.record("admission.schedule", w.trace, w.accepted_ns, released_ns)
                span = TRACER.start("admission.dispatch", w.trace, released_ns, pool=d.pool)
            topic = self._topics.dispatch(d.pool)
            trace = tracecontext.header(span.context) if span is not None else None
            headers = mac_headers(self._hop, topic, value, trace)
            outgoing.append(Outgoing(topic, value, w.key.encode(), partition, headers))
            chosen.append((w, verdict, placement, span))
        acks = await send_batched(self._producer, outgoing)
        sends: list[tuple[Waiting, Admit, asyncio.Future[Any], Span | None]] = []
        for (w, verdict, placement, span), ack in zip(chosen, acks, strict=True):
            if not (ack.done() and ack.exception() is not None):  # the producer took it
                self._capacity.dispatched(
                    verdict.dispatch.pool,
                    w.request.scoped_id,
                    mono,
                    engine_cost(w.cost, verdict.dispatch.degradation),
                    placement.worker_id if placement is not None else None,
                )
            sends.append((w, verdict, ack, span))
        return self._settle(sends) if sends else None

    async def _settle(
        self, sends: list[tuple[Waiting, Admit, asyncio.Future[Any], Span | None]]
    ) -> bool:
        """Once the broker answered: a dispatch it took is done (its offset may be
        committed); one it did not take goes back to its backlog (``False``); one it
        refused for itself is answered."""
        unsent: list[Waiting] = []
        # Awaited one by one, not gathered: a batch's records share its future, and a
        # gather would schedule a callback per record.
        admitted: list[tuple[str, str, Priority, InferenceRequest, str, Priority]] = []
        taken: list[Waiting] = []
        for w, admit, future, span in sends:
            try:
                await future
            except Exception as e:
                if is_infrastructure(e):
                    unsent.append(w)
                else:
                    self._answers.fail_waiting(w, e)
                continue
            if span is not None:
                span.end()
            taken.append(w)
            self._offsets.done(w.tp, w.offset)
            outcome = "admitted" if admit.reason is ReasonCode.NONE else "degraded"
            reason = admit.reason.value
            admitted.append(
                (outcome, reason, w.source, w.request, admit.dispatch.pool, w.accepted.cls)
            )
        self._corrections.sent(taken)  # from now on only its completion settles it
        m.dispatched(admitted)
        if unsent:
            log.warning(
                "the broker did not take dispatches; they wait", extra={"requests": len(unsent)}
            )
            self._backlog.requeue(unsent)
        return not unsent

    async def _cancelled(self, requests: list[InferenceRequest]) -> list[bool]:
        """Which requests carry their client's abort marker (none, if Redis is down)."""
        try:
            return await exists_each(
                self._redis, [self._keys.abort(r.tenant, r.request_id) for r in requests]
            )
        except STORE_ERRORS as e:
            m.QUOTA_STORE_ERRORS.labels("abort_check").inc()
            log.warning("could not check abort markers", extra={"error": str(e)})
            return [False] * len(requests)
