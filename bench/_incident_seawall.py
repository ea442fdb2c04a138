"""(b) seawall on virtual time: the real policy cores of admission, the workers and the
controller, composed as their service shells compose them.

What stands in for the shells' I/O (the end-to-end path through Kafka and Redis is what
the other benchmarks measure):

- Kafka: each hop (ingress → admission, admission → a pool's dispatch topic, a reply →
  its client, telemetry → controller and admission, control → admission and workers)
  is a delay of ``bus_delay_s``; nothing is lost or reordered. A pool's dispatch topic
  has one partition per worker (worker ``i`` owns partition ``i`` and says so in its
  heartbeats); admission places each record on a worker's partition, and that worker
  fetches it when its batch limit allows.
- Redis: the quota buckets are ``bucket.decide`` and ``bucket.adjust``, the pure model
  ``bucket.lua`` runs bit for bit, on the virtual clock.
- faust: one ``PoolDecider`` per pool gets every telemetry record and a ``tick`` every
  ``tick_s``; its events are applied by ``seq`` to a ``ControlState``.
- a worker host's CPU is not simulated: heartbeats report a constant ``HOST_CPU_PCT``.

Admission, as ``services.admission.service``: ``screen`` → the tenant's bucket →
``judge`` per request when read (a class's intake pauses at ``max_buffered_per_class``);
dispatch rounds (on news, and every ``dispatch_interval_s``) sweep expired requests every
``SWEEP_INTERVAL_S``, ``dispatching.pick`` what the pools can absorb, ``release`` each;
telemetry feeds ``FleetCapacity``; completions correct the tenants' token buckets, and a
request refused after it was charged is refunded. Workers, as
``services.workers.service``: at most ``batch_limit`` in flight (from ``BatchLimit``
events, within ``max_num_seqs``), a request past its deadline when it starts is expired,
a static-reply degradation answers without the engine, a truncation caps ``max_tokens``;
``RequestCompleted`` per request and a ``WorkerReport`` (engine, GPU, heartbeat and the
summary of the requests finished) every ``telemetry_interval_s``. An emergency restart
cannot be ordered here (the simulated GPUs do not leak memory) and would stop the run.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final

from _incident_des import Kind, Loop, Outcome, VirtualClock, VirtualEngine
from _incident_scenario import CLASSES, EPOCH, Arrival, Scenario, prompt_text, tier_configs
from aiokafka.partitioner import DefaultPartitioner

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    DispatchedRequest,
    EngineStats,
    InferenceReply,
    InferenceRequest,
    Priority,
    ReasonCode,
    ReplyStatus,
    RequestCompleted,
    SamplingParams,
    TelemetryEvent,
    Tier,
    WorkerHeartbeat,
    WorkerReport,
)
from services.admission.dispatcher import SWEEP_INTERVAL_S
from services.admission.policy.bucket import BucketState, Dimension, adjust, decide
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.decisions import NO_FORECASTS, AdmissionPolicy
from services.admission.policy.dispatching import Lane, Queued, forecasts, pick
from services.admission.policy.outcomes import Accepted, Reply
from services.admission.policy.round_budget import Placement
from services.admission.policy.routing import worker_share
from services.admission.policy.scheduler import PriorityScheduler
from services.admission.policy.sizing import engine_cost
from services.admission.settings import AdmissionSettings
from services.common.control_state import ControlState
from services.common.tokenizer import count_tokens
from services.controller.decider.pool import Output, PoolDecider
from services.controller.settings import ControllerSettings
from services.workers.engine.base import FinishReason
from services.workers.engine.sim_core import SimCore
from services.workers.policy.dispatches import ENGINE_PRIORITY, degraded_reason, max_output_tokens
from services.workers.policy.reports import gpu_stats, limits_info
from services.workers.policy.summary import RequestSummarizer
from services.workers.settings import WorkerSettings

POOLS: Final = ("main", "small")
REPLY_TO: Final = "bench.incident.replies"
HOST_CPU_PCT: Final = 25.0
HOST_MEMORY_PCT: Final = 40.0
SAMPLE_EVERY_S: Final = 1.0
PARTITIONER: Final = DefaultPartitioner()
WORKER: Final = WorkerSettings.model_construct()
"""The workers' defaults (initial batch limit, telemetry interval, canned reply)."""
ADMISSION: Final = AdmissionSettings.model_construct()
"""Admission's defaults (intake pause, dispatch interval)."""


@dataclass(frozen=True)
class Harness:
    time_scale: float = 0.05
    """``SEAWALL_CONTROLLER_TIME_SCALE``: every policy window and hold times this."""
    tick_s: float = 0.1
    """``SEAWALL_CONTROLLER_TICK_S``."""
    bus_delay_s: float = 0.01
    latency_recover_ms: float = 1500.0
    """``SEAWALL_CONTROLLER_LATENCY_RECOVER_MS``: this fleet's normal P99 is about 1.2 s,
    so DESIGN's 800 ms would keep a tripped breaker open for good; the SLO instead."""

    ttft_slo_ms: float | None = None
    """``SEAWALL_CONTROLLER_TTFT_SLO_MS``: the batch controller's TTFT target."""
    itl_slo_ms: float | None = None
    """``SEAWALL_CONTROLLER_ITL_SLO_MS``: the batch controller's inter-token target."""
    early_rejection: bool = False
    """``SEAWALL_EARLY_REJECTION``: refuse what the TTFT predictor says is too late."""
    scavenger_tiers: frozenset[Tier] = frozenset()
    """``SEAWALL_SCAVENGER_TIERS``: the tiers whose over-quota requests wait for idle
    capacity instead of being refused (work-conserving quotas)."""

    def controller_settings(self) -> ControllerSettings:
        return ControllerSettings.model_construct(
            controller_time_scale=self.time_scale,
            controller_latency_recover_ms=self.latency_recover_ms,
            controller_ttft_slo_ms=self.ttft_slo_ms,
            controller_itl_slo_ms=self.itl_slo_ms,
        )


@dataclass(frozen=True, slots=True)
class Change:
    """A control decision (not a re-publication), when the controller made it."""

    at: float
    key: str
    summary: str
    reason: str


@dataclass
class Trace:
    """What the control plane did, for the report and the plot."""

    changes: list[Change] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Once a second: the main pool's batch limits, its workers with an open breaker, its
    ladder level and breaker level, admission's backlog per class."""
    late_answers: int = 0
    """Answers that reached their client after it had given up (GPU time spent for no one)."""


@dataclass(slots=True, eq=False)
class _Waiting(Queued):
    request: InferenceRequest
    arrival: Arrival
    source: Priority
    accepted: Accepted
    since: float


def summarize(event: ControlEvent) -> str:
    if isinstance(event, BreakerState):
        return f"breaker {event.state} L{int(event.level)}"
    if isinstance(event, DegradationLevel):
        return f"degradation level {event.level}"
    if isinstance(event, BatchLimit):
        return f"batch limit {event.limit}"
    return event.kind


class _Worker:
    def __init__(
        self, run: SeawallRun, worker_id: str, pool: str, core: SimCore, index: int
    ) -> None:
        self.run = run
        self.id = worker_id
        self.index = index
        """The partition of its pool's dispatch topic it owns."""
        self.pool = pool
        self.engine = VirtualEngine(run.loop, core, self._done)
        self.batch_limit = min(WORKER.batch_limit, core.config.max_num_seqs)
        self.started_at = run.clock.time()
        self.completed_total = 0
        self.summary = RequestSummarizer(self.started_at)
        self.serving: dict[str, tuple[DispatchedRequest, float]] = {}
        """Request id → its dispatch and when this worker started it (loop time)."""
        self.partition: deque[DispatchedRequest] = deque()
        """Its partition of the pool's dispatch topic: records not fetched yet."""

    def fetch(self) -> None:
        """Take records from its partition while it has room under its batch limit."""
        while self.partition and len(self.serving) < self.batch_limit:
            self.start(self.partition.popleft())

    def set_batch_limit(self, limit: int) -> None:
        self.batch_limit = max(1, min(limit, self.engine.core.config.max_num_seqs))

    def start(self, d: DispatchedRequest) -> None:
        req = d.request
        self.serving[req.request_id] = (d, self.run.loop.now)
        if req.deadline_at is not None and self.run.clock.time() > req.deadline_at:
            self._finish(req.request_id, "expired", ReasonCode.DEADLINE_EXCEEDED, 0, None)
        elif d.degradation.static_reply:
            tokens = count_tokens(WORKER.static_reply)
            self._finish(req.request_id, "static", ReasonCode.DEGRADED_STATIC, tokens, None)
        else:
            prompt = self.run.arrivals[req.request_id].prompt_tokens
            self.engine.add(
                req.request_id, prompt, max_output_tokens(d), ENGINE_PRIORITY[req.priority]
            )

    def _done(self, rid: str, reason: FinishReason, tokens: int, first: float | None) -> None:
        if reason == "error":
            raise RuntimeError("the simulated engines inject no errors in this benchmark")
        code = degraded_reason(self.serving[rid][0])
        self._finish(rid, "ok" if code is ReasonCode.NONE else "degraded", code, tokens, first)

    def _finish(
        self, rid: str, kind: Kind, code: ReasonCode, tokens: int, first: float | None
    ) -> None:
        d, started = self.serving.pop(rid)
        run, now = self.run, self.run.loop.now
        arrival = run.arrivals[rid]
        run.to_client(arrival, kind, code.value)
        self.completed_total += 1
        ttft_ms = None if first is None else (first - started) * 1000
        prompt_tokens = arrival.prompt_tokens if kind in ("ok", "degraded") else 0
        self.summary.add((now - started) * 1000, True, ttft_ms, prompt_tokens, tokens)
        run.completion(
            RequestCompleted(
                worker_id=self.id,
                pool=self.pool,
                request_id=rid,
                tenant=d.request.tenant,
                priority=d.request.priority,
                tier=d.request.tier,
                queue_wait_ms=min(86_400_000, max(0.0, EPOCH + started - d.admitted_at) * 1000),
                ttft_ms=ttft_ms,
                latency_ms=(now - started) * 1000,
                prompt_tokens=prompt_tokens,
                completion_tokens=tokens,
                at=EPOCH + now,
                seq=self.completed_total,
            )
        )
        run.loop.at(now, self.fetch)  # a slot is free (not nested: start may finish at once)

    def report(self) -> None:
        """The worker's telemetry round: one report of its engine, its GPU, a heartbeat
        and the requests it finished since the last."""
        run, core = self.run, self.engine.core
        stats, gpu = core.stats(run.loop.now), core.gpu_reading(run.loop.now)
        limits = core.config.limits()
        in_flight = len(self.serving)
        common: dict[str, Any] = {"worker_id": self.id, "pool": self.pool, "at": run.clock.time()}
        counted = {"in_flight": in_flight, "completed_total": self.completed_total}
        run.telemetry(
            WorkerReport(
                **common,
                engine=EngineStats(
                    **common,
                    **counted,
                    engine="sim",
                    running=stats.running,
                    waiting=stats.waiting,
                    preempted_total=stats.preempted_total,
                    kv_cache_usage=stats.kv_cache_usage,
                    batch_limit=self.batch_limit,
                    limits=limits_info(limits),
                    prefill_pending_tokens=self.engine.prefill_pending_tokens,
                    prefilled_tokens_total=self.engine.prefilled_tokens_total,
                ),
                gpus=(gpu_stats(replace(gpu, simulated=True), self.id, self.pool, common["at"]),),
                heartbeat=WorkerHeartbeat(
                    **common,
                    **counted,
                    engine="sim",
                    status="serving",
                    batch_limit=self.batch_limit,
                    host_cpu_pct=HOST_CPU_PCT,
                    host_memory_pct=HOST_MEMORY_PCT,
                    started_at=self.started_at,
                    partitions=(self.index,),
                ),
                requests=self.summary.take(common["at"]),
            )
        )


class SeawallRun:
    def __init__(self, scenario: Scenario, arrivals: list[Arrival], harness: Harness) -> None:
        self.scenario = scenario
        self.harness = harness
        self.arrivals = {a.request_id: a for a in arrivals}
        self._order = arrivals
        self.loop = Loop()
        self.clock = VirtualClock(self.loop)
        self.trace = Trace()
        self.outcomes: dict[int, Outcome] = {}
        # admission
        self.tiers = tier_configs(scenario)
        self.policy = AdmissionPolicy(
            PolicyConfig(tiers=self.tiers, pools=POOLS, scavenger_tiers=harness.scavenger_tiers)
        )
        self.capacity = FleetCapacity()
        self.schedulers = {pool: PriorityScheduler() for pool in POOLS}
        self.control = ControlState(self.clock)
        self.queues: defaultdict[tuple[Lane, str], deque[_Waiting]] = defaultdict(deque)
        self.unread: dict[Priority, deque[InferenceRequest]] = {c: deque() for c in CLASSES}
        self.buffered: Counter[Priority] = Counter()
        self.buckets: dict[str, dict[Dimension, BucketState]] = {}
        self.reserved: dict[str, float] = {}
        self._round_due = False
        self._last_sweep = 0.0
        # the controller
        self.decider_config = harness.controller_settings().decider_config()
        self.deciders: dict[str, PoolDecider] = {}
        # the workers
        self.workers: dict[str, _Worker] = {}
        self.partitions: dict[str, list[_Worker]] = {p: [] for p in POOLS}
        fleet = (
            ("main", scenario.main_model, scenario.main_gpus),
            ("small", scenario.small_model, scenario.small_gpus),
        )
        for pool, model, n in fleet:
            config = scenario.engine(model)
            for i in range(n):
                worker_id = f"{pool}-{i:02d}"
                core = SimCore(config, seed=i)
                worker = self.workers[worker_id] = _Worker(self, worker_id, pool, core, i)
                self.partitions[pool].append(worker)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> tuple[list[Outcome], Trace]:
        s, loop = self.scenario, self.loop
        horizon = s.end + s.timeout_s + 2.0
        for a in self._order:
            loop.at(a.at, partial(self._arrive, a))
        loop.every(self.harness.tick_s, self._tick, start=0.0, until=horizon)
        loop.every(ADMISSION.dispatch_interval_s, self._wake, start=0.0, until=horizon)
        loop.every(SAMPLE_EVERY_S, self._sample, start=0.0, until=horizon)
        period = WORKER.telemetry_interval_s
        for i, worker in enumerate(self.workers.values()):
            phase = period * i / len(self.workers)
            loop.every(period, worker.report, start=phase, until=horizon)
        loop.run()
        return [self.outcomes[a.index] for a in self._order], self.trace

    def hop(self, fn: Callable[[], None]) -> None:
        """One Kafka hop."""
        self.loop.after(self.harness.bus_delay_s, fn)

    # -- clients -----------------------------------------------------------------------
    def _arrive(self, a: Arrival) -> None:
        created = self.clock.time()
        request = InferenceRequest(
            request_id=a.request_id,
            tenant=a.tenant,
            priority=a.priority,
            tier=a.tier,
            pool="main",
            prompt=prompt_text(a.prompt_tokens),
            sampling=SamplingParams(max_tokens=a.max_tokens),
            reply_to=REPLY_TO,
            created_at=created,
            deadline_at=created + self.scenario.timeout_s,
        )
        self.loop.after(self.scenario.timeout_s, lambda: self._give_up(a))
        self.hop(lambda: self._intake(request))

    def _give_up(self, a: Arrival) -> None:
        if a.index not in self.outcomes:
            timeout = self.scenario.timeout_s
            self.outcomes[a.index] = Outcome(a, "timed_out", "client_timeout", timeout)

    def to_client(self, a: Arrival, kind: Kind, reason: str) -> None:
        """A terminal reply, produced now: its client reads it one hop later."""

        def receive() -> None:
            had = self.outcomes.get(a.index)
            if had is None:
                latency = self.loop.now - a.at if kind in ("ok", "degraded", "static") else None
                self.outcomes[a.index] = Outcome(a, kind, reason, latency)
            elif kind == "expired":  # the client gave up at the deadline: say why
                self.outcomes[a.index] = Outcome(a, kind, reason, had.latency)
            elif kind in ("ok", "degraded"):
                self.trace.late_answers += 1

        self.hop(receive)

    def _reply(self, request: InferenceRequest, reply: InferenceReply) -> None:
        kind: Kind = "expired" if reply.status is ReplyStatus.EXPIRED else "rejected"
        self.to_client(self.arrivals[request.request_id], kind, reply.reason.value)

    # -- admission: intake ---------------------------------------------------------------
    def _intake(self, request: InferenceRequest) -> None:
        self.unread[request.priority].append(request)
        self._read()

    def _read(self) -> None:
        """Decide what the intake reads: a class with a full backlog stays paused."""
        decided = False
        for cls in CLASSES:
            unread = self.unread[cls]
            while unread and self.buffered[cls] < ADMISSION.max_buffered_per_class:
                self._decide(unread.popleft(), cls)
                decided = True
        if decided:
            self._wake()

    def _decide(self, request: InferenceRequest, cls: Priority) -> None:
        now = self.clock.time()
        ahead = (
            forecasts(self.queues, POOLS, self.capacity, self.clock.monotonic())
            if self.harness.early_rejection
            else NO_FORECASTS
        )
        verdict = self.policy.screen(request, cls, self.control, now, forecasts=ahead)
        if isinstance(verdict, Reply):
            self._reply(request, verdict.reply)
            return
        assert verdict.region is None  # no region throttles in this scenario
        q = verdict.tenant
        states = self.buckets.get(q.tenant, {})
        decision, self.buckets[q.tenant] = decide(q.config, states, now, q.requests, q.tokens)
        judged = self.policy.judge(request, cls, verdict, now, decision)
        if isinstance(judged, Reply):
            self._reply(request, judged.reply)
            return
        arrival = self.arrivals[request.request_id]
        w = _Waiting(request, arrival, cls, judged, self.clock.monotonic())
        if judged.reserved_tokens > 0:
            self.reserved[request.request_id] = judged.reserved_tokens
        self.queues[(w.lane, judged.pool)].append(w)
        self.buffered[cls] += 1

    # -- admission: dispatch -------------------------------------------------------------
    def _wake(self) -> None:
        if not self._round_due:
            self._round_due = True
            self.loop.at(self.loop.now, self._round)

    def _round(self) -> None:
        self._round_due = False
        now = self.clock.monotonic()
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            self._release(self._take_expired())
        chosen = pick(
            self.queues, POOLS, self.policy, self.control, self.capacity, self.schedulers, now
        )
        self._unbuffer(chosen.picked)
        self._unbuffer(chosen.shed)
        for w in chosen.shed:
            self._reply(w.request, self.policy.shed(w.request, w.accepted, self.clock.time()).reply)
        self._release(chosen.picked, chosen.placements)
        self._read()

    def _take_expired(self) -> list[_Waiting]:
        now = self.clock.time()
        expired: list[_Waiting] = []
        for key, dq in self.queues.items():
            if any(w.request.expired(now) for w in dq):
                expired += [w for w in dq if w.request.expired(now)]
                self.queues[key] = deque(w for w in dq if not w.request.expired(now))
        self._unbuffer(expired)
        return expired

    def _unbuffer(self, taken: list[_Waiting]) -> None:
        for w in taken:
            self.buffered[w.source] -= 1

    def _release(self, picked: list[_Waiting], placements: Sequence[Placement | None] = ()) -> None:
        now, mono = self.clock.time(), self.clock.monotonic()
        for w, placement in zip(picked, list(placements) or [None] * len(picked), strict=True):
            verdict = self.policy.release(w.request, w.accepted.cls, w.accepted, self.control, now)
            if isinstance(verdict, Reply):
                self._reply(w.request, verdict.reply)
                self._settle(w.request.request_id, w.request.tenant, w.arrival, 0)
                continue
            d = verdict.dispatch
            if placement is not None and placement.pool != d.pool:
                placement = None
            cost = engine_cost(w.cost, d.degradation)
            worker = None if placement is None else placement.worker_id
            self.capacity.dispatched(d.pool, w.request.request_id, mono, cost, worker)
            partition = None if placement is None else placement.partition
            self.hop(partial(self._to_pool, d, partition))

    def _to_pool(self, d: DispatchedRequest, partition: int | None) -> None:
        """The record lands on its partition: admission's placement, else the
        producer's partitioner on its key; worker ``i`` of the pool owns partition ``i``
        and fetches from it only."""
        owners = self.partitions[d.pool]
        if partition is None:
            index = list(range(len(owners)))
            partition = PARTITIONER(d.request.dispatch_key.encode(), index, index)
        worker = owners[partition]
        worker.partition.append(d)
        worker.fetch()

    def _settle(self, rid: str, tenant: str, arrival: Arrival, actual: float) -> None:
        """Correct the tenant's tokens bucket by ``actual − reserved`` (0: a refund)."""
        reserved = self.reserved.pop(rid, None)
        if reserved is None:
            return
        now = self.clock.time()
        config = self.policy.tenant_config(tenant, arrival.tier, self.control, now)
        limit = (config or self.tiers[arrival.tier]).tokens
        states = self.buckets[tenant]
        states["tokens"] = adjust(states.get("tokens"), actual - reserved, now, limit)

    # -- telemetry -----------------------------------------------------------------------
    def telemetry(self, event: TelemetryEvent) -> None:
        self.hop(lambda: self._observe(event))

    def _observe(self, event: TelemetryEvent) -> None:
        # the controller (its decide agent) ...
        now = self.clock.time()
        decider = self.deciders.get(event.pool)
        if decider is None:
            decider = self.deciders[event.pool] = PoolDecider(event.pool, self.decider_config, now)
        self._publish(decider.observe(event, now))
        # ... and admission (its telemetry loop)
        self.capacity.observe(event, self.clock.monotonic())
        self._wake()

    def completion(self, event: RequestCompleted) -> None:
        self.hop(lambda: self._complete(event))

    def _complete(self, event: RequestCompleted) -> None:
        """Admission's telemetry loop (the slot) and its corrections loop (the tokens)."""
        self.capacity.completed(
            event.worker_id, event.request_id, self.clock.monotonic(), event.seq
        )
        arrival = self.arrivals[event.request_id]
        actual = event.prompt_tokens + event.completion_tokens
        self._settle(event.request_id, event.tenant, arrival, actual)
        self._wake()

    # -- the controller ------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock.time()
        for decider in list(self.deciders.values()):
            self._publish(decider.tick(now))

    def _publish(self, output: Output) -> None:
        for event in output.changes:
            self.trace.changes.append(
                Change(self.loop.now, event.control_key, summarize(event), event.evidence.reason)
            )
        for event in output.events:
            self.hop(partial(self._apply, event))

    def _apply(self, event: ControlEvent) -> None:
        """The event reaches admission's and the workers' control followers."""
        if not self.control.apply(event):
            return
        if isinstance(event, BreakerState):
            kind, _, name = event.scope.partition(":")
            if kind == "worker":
                share = worker_share(event, self.policy.config.rate_limit_factor)
                self.capacity.share(name, share)
                worker = self.workers[name]
                if event.level >= BreakerLevel.EMERGENCY and event.issued_at > worker.started_at:
                    raise RuntimeError(f"emergency restart of {name}: not modelled here")
        elif isinstance(event, BatchLimit):
            worker = self.workers[event.worker_id]
            worker.set_batch_limit(event.limit)
            worker.fetch()
        self._wake()

    # -- the trace -----------------------------------------------------------------------
    def _sample(self) -> None:
        main = [w for w in self.workers.values() if w.pool == "main"]
        breaker = self.control.get(BreakerState, "pool:main")
        ladder = self.control.get(DegradationLevel, "pool:main")
        isolated = 0
        for w in main:
            state = self.control.get(BreakerState, f"worker:{w.id}")
            isolated += state is not None and state.state == "open"
        self.trace.samples.append(
            {
                "t": self.loop.now,
                "batch_limit_mean": sum(w.batch_limit for w in main) / len(main),
                "in_flight_main": sum(len(w.serving) for w in main),
                "open_worker_breakers": isolated,
                "degradation_level": 0 if ladder is None else ladder.level,
                "pool_breaker_level": 0 if breaker is None else int(breaker.level),
                "backlog": {
                    c.value: sum(len(dq) for (k, _), dq in self.queues.items() if k is c)
                    for c in CLASSES
                },
            }
        )
