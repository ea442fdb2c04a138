"""The controller's core for one pool: telemetry in, control events out. Pure: no
Kafka, no faust; time is what the caller passes as ``now`` (it never goes backwards
here, even if the wall clock does).

Scopes and what is decided for them:

- ``worker:<id>``: a ``BreakerState`` (the breaker matrix on the worker's own windows,
  plus heartbeat loss) and a ``BatchLimit`` (the adaptive batch limit, from the
  latencies of the requests it finished — one ``RequestSummary`` per report, so the
  cost is per worker-second — and its engine's preemptions and waiting queue,
  within its engine's ``max_num_seqs``);
- ``pool:<name>``: a ``BreakerState`` (the matrix on the pool's windows: every sample of
  its workers) and a ``DegradationLevel`` (the ladder on the pool's requests, its
  engines' preemptions and the hottest GPU of the pool).

Every scope gets an explicit state from its first sight (closed breaker, level 0, the
worker's own batch limit), so that consumers read a decision, not the absence of one.

Events: a policy ``Decision`` becomes a control event at once (a *change*); the state
in force is re-published every ``republish_s`` with a new ``seq`` (level-triggered). A
re-publication keeps ``issued_at`` (when the decision was made) and extends
``valid_for_s``, which counts from ``issued_at``: a consumer trusts a decision while
``issued_at + valid_for_s`` is ahead of its clock, and one-shot orders (restart the
worker) can be told apart from their re-publications. ``seq`` is a hybrid clock,
``max(last + 1, µs since the epoch)``: it increases across restarts without
coordination.

Restart safety: ``records()`` is what the shell persists: a ``PoolRecord`` (the pool's
own decisions and the sequence) and a ``WorkerRecord`` per worker (its decisions and
its engine's ``max_num_seqs``), so that a change costs one small record whatever the
size of the pool; ``take_records()`` returns only the records changed since its last
call. A ``PoolEngine`` built from them re-publishes those decisions at its first
``tick`` and seeds the policies from them, so that a tripped breaker stays open until
its recovery condition holds again in full and a batch limit continues from its last
value. The windows refill from fresh telemetry.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, TypeVar, cast

from pydantic import Field

from schemas import (
    BatchLimit,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    EngineStats,
    Evidence,
    GpuStats,
    RequestSummary,
    TelemetryEvent,
    WorkerHeartbeat,
    WorkerReport,
)
from schemas.base import Ident, Wire
from services.common.sketch import ddsketch_of
from services.controller.policy import (
    AdaptiveBatchLimit,
    BatchConfig,
    Breaker,
    BreakerConfig,
    BreakerStatus,
    Circuit,
    Decision,
    DegradationConfig,
    DegradationLadder,
    DegradationStatus,
    GaugeWindow,
    HeartbeatConfig,
    HeartbeatMonitor,
    Liveness,
    Reading,
    RequestWindow,
    Samples,
    Threshold,
    breaker_readings,
    degradation_readings,
)
from services.controller.policy import Evidence as PolicyEvidence
from services.controller.policy.breaker import HEARTBEAT, LATENCY_ROW
from services.controller.policy.canary import Arm
from services.controller.policy.freshness import WorkerClock
from services.controller.policy.shares import (
    LONG_PROMPTS,
    OUTPUT_MISMATCH_RATE,
    OUTPUT_MISMATCHES,
    ShareAlert,
)

MAX_SECONDS = 86_400.0
"""The wire's bound on a duration (``schemas.base.Seconds``)."""
MAX_EVIDENCE_ENTRIES = 32
MAX_METRIC_NAME = 64
REQUEST_BUCKETS = 30
GAUGE_BUCKETS = 10

K = TypeVar("K", bound=str)
E = TypeVar("E", bound=ControlEvent)


@dataclass(frozen=True)
class EngineConfig:
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    republish_s: float = 5.0
    valid_for_s: float = 60.0
    forget_after_s: float = 600.0
    max_telemetry_age_s: float = 30.0
    small_pool: str = "small"
    max_tokens_cap: int = 512
    host_cpu_breaker: bool = True
    """Whether heartbeats' host CPU feeds the breaker matrix. Off where workers share
    one host (the embedded stack): there it says nothing about any one worker."""
    output_mismatch_rate: Threshold = OUTPUT_MISMATCH_RATE
    """The output-consistency alert's bound (``policy.shares``)."""

    def __post_init__(self) -> None:
        if not 0 < self.republish_s < self.valid_for_s <= MAX_SECONDS:
            raise ValueError(
                "need 0 < republish_s < valid_for_s <= 86400: decisions must not expire at "
                "their consumers between two re-publications"
            )
        if self.forget_after_s <= 0 or self.max_telemetry_age_s <= 0:
            raise ValueError("forget_after_s and max_telemetry_age_s must be > 0")

    @property
    def request_window_s(self) -> float:
        """The longest window any request-based row or rung reads."""
        rows = (self.breaker.error_rate, self.breaker.latency_p99_ms)
        rungs = (self.degradation.latency_p99_ms, self.degradation.error_rate)
        return max(t.window_s for t in (*rows, *rungs))

    @property
    def gauge_window_s(self) -> float:
        rows = (self.breaker.cpu_percent, self.breaker.gpu_memory_percent)
        rungs = (self.degradation.gpu_temperature_c, self.degradation.preemptions_per_s)
        return max(t.window_s for t in (*rows, *rungs))

    def request_window(self) -> RequestWindow:
        size = self.request_window_s
        return RequestWindow(size, size / REQUEST_BUCKETS)

    def gauge_window(self) -> GaugeWindow:
        size = self.gauge_window_s
        return GaugeWindow(size, size / GAUGE_BUCKETS)


def _scaled(t: Threshold, k: float) -> Threshold:
    return replace(
        t,
        window_s=t.window_s * k,
        trip_hold_s=t.trip_hold_s * k,
        recover_hold_s=t.recover_hold_s * k,
    )


def samples_of(summary: RequestSummary) -> Samples:
    """A summary (``count`` > 0) as the batch limit reads it."""
    n = summary.count
    return Samples(
        n,
        summary.latency_sum_ms / n,
        summary.latency_m2_ms2,
        ttft_count=summary.ttft_count,
        ttft_mean_ms=summary.ttft_sum_ms / summary.ttft_count if summary.ttft_count else 0.0,
        itl_count=summary.itl_count,
        itl_mean_ms=summary.itl_sum_ms / summary.itl_count if summary.itl_count else 0.0,
    )


def scaled_config(
    time_scale: float,
    *,
    batch_sla_ms: float,
    heartbeat_timeout_s: float,
    republish_s: float,
    valid_for_s: float,
    forget_after_s: float,
    max_telemetry_age_s: float,
    small_pool: str,
    max_tokens_cap: int,
    host_cpu_breaker: bool = True,
    latency_trip_ms: float = LATENCY_ROW.trip_above,
    latency_recover_ms: float = LATENCY_ROW.recover_below,
    ttft_slo_ms: float | None = None,
    itl_slo_ms: float | None = None,
    output_mismatch_rate: float = OUTPUT_MISMATCH_RATE.trip_above,
) -> EngineConfig:
    """The default policies with every window and hold multiplied by ``time_scale``, and
    the latency row's thresholds as given (DESIGN's 2000/800 ms fit a fleet whose normal
    P99 is well under 800 ms; one that runs near 1.2 s would never recover below 800)."""
    k = time_scale
    d = DegradationConfig()
    b = BreakerConfig(
        latency_p99_ms=replace(
            LATENCY_ROW, trip_above=latency_trip_ms, recover_below=latency_recover_ms
        )
    )
    return EngineConfig(
        breaker=replace(
            b,
            error_rate=_scaled(b.error_rate, k),
            latency_p99_ms=_scaled(b.latency_p99_ms, k),
            cpu_percent=_scaled(b.cpu_percent, k),
            gpu_memory_percent=_scaled(b.gpu_memory_percent, k),
            probe_retry_s=b.probe_retry_s * k,
        ),
        degradation=DegradationConfig(
            latency_p99_ms=_scaled(d.latency_p99_ms, k),
            error_rate=_scaled(d.error_rate, k),
            gpu_temperature_c=_scaled(d.gpu_temperature_c, k),
            preemptions_per_s=_scaled(d.preemptions_per_s, k),
        ),
        batch=replace(
            BatchConfig(),
            sla_ms=batch_sla_ms,
            ttft_slo_ms=ttft_slo_ms,
            itl_slo_ms=itl_slo_ms,
            min_interval_s=BatchConfig().min_interval_s * k,
            preemption_hold_s=BatchConfig().preemption_hold_s * k,
            queue_hold_s=BatchConfig().queue_hold_s * k,
        ),
        heartbeat=HeartbeatConfig(timeout_s=heartbeat_timeout_s),
        republish_s=republish_s,
        valid_for_s=valid_for_s,
        forget_after_s=forget_after_s,
        max_telemetry_age_s=max_telemetry_age_s,
        small_pool=small_pool,
        max_tokens_cap=max_tokens_cap,
        host_cpu_breaker=host_cpu_breaker,
        output_mismatch_rate=_scaled(
            replace(
                OUTPUT_MISMATCH_RATE,
                trip_above=output_mismatch_rate,
                recover_below=output_mismatch_rate / 2,
            ),
            k,
        ),
    )


Seq = Annotated[int, Field(ge=0, le=2**62)]


class PoolRecord(Wire):
    """What survives a restart of a pool's own state."""

    pool: Ident
    seq: Seq
    """The sequence when written: a restarted engine continues above every record's."""
    events: tuple[ControlEvent, ...] = ()
    """The pool's decisions in force, as last published."""
    degradation_triggered: tuple[str, ...] = ()
    """The ladder's triggered rungs (the event carries only the level)."""


class WorkerRecord(Wire):
    """What survives a restart of one worker's state in its pool."""

    pool: Ident
    worker_id: Ident
    seq: Seq
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    """Its engine's ``max_num_seqs`` (``None``: not known yet)."""
    events: tuple[ControlEvent, ...] = ()
    """The worker's decisions in force, as last published."""
    clock_anchor: tuple[float, float] | None = None
    """Its reports' freshness anchor (``policy.freshness``): the worker's ``at`` and the
    controller's time it was read."""


@dataclass(frozen=True)
class Records:
    """Records to persist: the pool's, and per worker id its record or ``None`` for a
    worker forgotten (its record is to be deleted)."""

    pool: PoolRecord | None = None
    workers: Mapping[str, WorkerRecord | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.pool is not None or bool(self.workers)


@dataclass(frozen=True)
class Output:
    changes: tuple[ControlEvent, ...] = ()
    """New decisions: persist ``record()`` before publishing them."""
    republished: tuple[ControlEvent, ...] = ()
    """The decisions in force again, each with a new ``seq``."""
    stale: bool = False
    """The telemetry record was too old to count and was skipped."""

    @property
    def events(self) -> tuple[ControlEvent, ...]:
        return self.changes + self.republished


def _finite(values: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in values.items():
        if len(out) == MAX_EVIDENCE_ENTRIES:
            break
        if math.isfinite(value):
            out[name[:MAX_METRIC_NAME]] = value
    return out


def _seconds(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return min(MAX_SECONDS, max(0.0, value))


def wire_evidence(evidence: PolicyEvidence, previous: str | None) -> Evidence:
    """The policy's evidence within the wire's bounds (text lengths, entry counts,
    finite numbers, durations of at most a day)."""
    return Evidence(
        reason=evidence.reason[:512],
        window_s=_seconds(evidence.window_s) or 0.0,
        metrics=_finite(evidence.metrics),
        thresholds=_finite(evidence.thresholds),
        hold_s=_seconds(evidence.hold_s),
        previous=None if previous is None else previous[:512],
    )


def _latched(decision: Decision[bool] | None, current: Evidence | None) -> Evidence | None:
    """A share alert's evidence while it is on, after its latest evaluation."""
    if decision is None:
        return current
    return wire_evidence(decision.evidence, "off") if decision.new_state else None


def republished(event: E, now: float, seq: int, valid_for_s: float) -> E:
    """A decision still in force, published again: valid ``valid_for_s`` from now, with
    its ``issued_at`` kept (readers see since when it holds) until that would take
    ``valid_for_s`` past the wire's bound (a day), when it is issued afresh."""
    age = max(0.0, now - event.issued_at)
    update: dict[str, float | int] = {"seq": seq}
    if age + valid_for_s <= MAX_SECONDS:
        update["valid_for_s"] = age + valid_for_s
    else:
        update.update(issued_at=now, valid_for_s=valid_for_s)
    return cast(E, event.model_copy(update=update))


def describe_breaker(status: BreakerStatus) -> str:
    if status.circuit is Circuit.CLOSED:
        return "closed"
    causes = ",".join(status.tripped) or "-"
    return f"{status.circuit.value} level={status.level.name} tripped={causes}"


def describe_degradation(status: DegradationStatus) -> str:
    return f"level {status.level} ({','.join(status.triggered) or 'none triggered'})"


def _values(readings: Mapping[K, Reading | None]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, reading in readings.items():
        if reading is not None:
            out[name] = reading.value
            out[f"{name}.samples"] = float(reading.samples)
    return out


def memory_headroom_pct(used_bytes: int, total_bytes: int, reserved: float) -> float:
    """GPU memory in use beyond the engine's reservation, as a percentage of the rest.

    vLLM allocates ``gpu_memory_utilization`` of the board (weights and the whole KV
    cache) when it starts, so raw use sits at 85-90 % on a healthy worker and the
    breaker's GPU-memory row (trip above 85 %, emergency restart) would fire forever.
    Measured against the headroom instead, a healthy engine reads 0 % and a leak climbs
    to 100 % as it eats what is left of the board. ``reserved`` 0 (unknown) is raw use.
    """
    if total_bytes <= 0:
        return 0.0
    used = used_bytes / total_bytes
    if reserved >= 1.0:
        return 100.0 if used > 1.0 else 0.0
    return 100.0 * min(1.0, max(0.0, (used - reserved) / (1.0 - reserved)))


class _Worker:
    def __init__(self, worker_id: str, config: EngineConfig) -> None:
        self.id = worker_id
        self.scope = f"worker:{worker_id}"
        self.requests = config.request_window()
        self.cpu = config.gauge_window()
        self.gpu_memory = config.gauge_window()
        self.breaker = Breaker(self.scope, config.breaker)
        self.batch: AdaptiveBatchLimit | None = None
        self.max_num_seqs: int | None = None
        self.lost_since: float | None = None
        self.preempted_total: int | None = None
        self.clock = WorkerClock(config.max_telemetry_age_s)
        """Whether its reports are current (``policy.freshness``: no clock compared)."""
        self.incarnation: str | None = None
        """The process last heard from under this id (its heartbeats say)."""
        self.memory_reserved: float | None = None
        """The engine's ``gpu_memory_utilization``, from its ``EngineStats``; until one
        arrives (telemetry of different kinds can come out of order, e.g. from a backlog
        read at start) GPU memory is not judged at all."""


class PoolEngine:
    """The decisions for one pool and its workers (see the module docstring)."""

    def __init__(
        self,
        pool: str,
        config: EngineConfig,
        now: float,
        record: PoolRecord | None = None,
        workers: Iterable[WorkerRecord] = (),
    ) -> None:
        """``record`` and ``workers``: what an earlier engine persisted for the pool
        (worker records without a pool record are ignored: the pool starts afresh)."""
        self.pool = pool
        self.scope = f"pool:{pool}"
        self.config = config
        self._now = now
        self._seq = 0
        self._in_force: dict[str, ControlEvent] = {}
        self._keys_by_scope: defaultdict[str, set[str]] = defaultdict(set)
        """The control keys in force per scope (records are written per scope)."""
        self._changes: list[ControlEvent] = []
        self._dirty: set[str] = set()
        """Scopes whose record changed since the last ``take_records``."""
        self._last_republish = -math.inf
        self._workers: dict[str, _Worker] = {}
        self._monitor = HeartbeatMonitor(config.heartbeat)
        self._requests = config.request_window()
        self._cpu = config.gauge_window()
        self._gpu_memory = config.gauge_window()
        self._gpu_temperature = config.gauge_window()
        self._preemptions = config.gauge_window()
        """Per engine report, the preemptions since that engine's previous report."""
        self._kv_usage = config.gauge_window()
        self._waiting = config.gauge_window()
        self._breaker = Breaker(self.scope, config.breaker)
        self._ladder = DegradationLadder(self.scope, config.degradation)
        self._long_prompts = ShareAlert(LONG_PROMPTS, self.scope)
        self.long_prompts: Evidence | None = None
        """While long prompts are over their share in this pool, the evidence of it
        (an alert, not a control decision: nothing acts on it but an operator)."""
        self._mismatches = ShareAlert(
            replace(OUTPUT_MISMATCHES, share=config.output_mismatch_rate), self.scope
        )
        self.output_mismatches: Evidence | None = None
        """While the pool's outputs disagree with their shadow runs past the bound,
        the evidence of it (an alert, as ``long_prompts``)."""
        self.inputs: dict[str, dict[str, float]] = {}
        """Per scope, the signals of the last evaluation (for the metrics)."""
        self._observed: set[str] = set()
        """Workers with telemetry since the last evaluation (``react`` evaluates them)."""
        if record is None:
            first = PolicyEvidence(reason=f"pool {pool} first seen")
            self._issue_breaker(self.scope, BreakerStatus(), first, None, now)
            self._issue_degradation(DegradationStatus(), first, None, now)
            self._last_republish = now  # just issued
        else:
            self._restore(record, list(workers), now)  # re-published at the first tick

    # -- restart ---------------------------------------------------------------
    def _restore(self, record: PoolRecord, workers: list[WorkerRecord], now: float) -> None:
        self._seq = max([record.seq, *(w.seq for w in workers)])
        for saved in workers:
            worker = self._workers[f"worker:{saved.worker_id}"] = _Worker(
                saved.worker_id, self.config
            )
            worker.max_num_seqs = saved.max_num_seqs
            if saved.clock_anchor is not None:
                worker.clock.anchor_at, worker.clock.anchor_now = saved.clock_anchor
        events = [*record.events, *(e for w in workers for e in w.events)]
        for event in events:
            if self._seed(event, record.degradation_triggered, now):
                self._set_in_force(event)
        for scope, worker in self._workers.items():
            lost = HEARTBEAT in worker.breaker.status.tripped
            self._monitor.restore(scope, now, Liveness.LOST if lost else Liveness.ALIVE)
            worker.lost_since = now if lost else None

    def _seed(self, event: ControlEvent, triggered: tuple[str, ...], now: float) -> bool:
        """Seed the policy the event decided for; False if its scope is not ours."""
        if isinstance(event, BreakerState):
            status = BreakerStatus(
                Circuit(event.state), event.level, event.tripped, event.probe_requests
            )
            if event.scope == self.scope:
                self._breaker.restore(status, now)
                return True
            if event.scope in self._workers:
                self._workers[event.scope].breaker.restore(status, now)
                return True
        elif isinstance(event, DegradationLevel) and event.scope == self.scope:
            self._ladder.restore(DegradationStatus(event.level, triggered))
            return True
        elif isinstance(event, BatchLimit) and event.scope in self._workers:
            worker = self._workers[event.scope]
            if worker.max_num_seqs is not None:
                worker.batch = AdaptiveBatchLimit(
                    worker.scope, worker.max_num_seqs, self.config.batch, event.limit
                )
                return True
        return False

    def records(self) -> Records:
        """Every record of the pool (what a restarted engine is built from)."""
        return self._records([self.scope, *self._workers])

    def take_records(self) -> Records:
        """The records changed since the last call (what the shell persists); falsy if
        none did."""
        dirty, self._dirty = self._dirty, set()
        return self._records(dirty)

    def _records(self, scopes: Iterable[str]) -> Records:
        pool: PoolRecord | None = None
        workers: dict[str, WorkerRecord | None] = {}
        for scope in scopes:
            if scope == self.scope:
                pool = PoolRecord(
                    pool=self.pool,
                    seq=self._seq,
                    events=self._events_of(scope),
                    degradation_triggered=self._ladder.status.triggered,
                )
                continue
            worker_id = scope.removeprefix("worker:")
            worker = self._workers.get(scope)
            workers[worker_id] = (
                None
                if worker is None
                else WorkerRecord(
                    pool=self.pool,
                    worker_id=worker_id,
                    seq=self._seq,
                    max_num_seqs=worker.max_num_seqs,
                    events=self._events_of(scope),
                    clock_anchor=worker.clock.anchor,
                )
            )
        return Records(pool, workers)

    def _events_of(self, scope: str) -> tuple[ControlEvent, ...]:
        return tuple(self._in_force[key] for key in sorted(self._keys_by_scope.get(scope, ())))

    def _set_in_force(self, event: ControlEvent) -> None:
        self._in_force[event.control_key] = event
        self._keys_by_scope[event.scope].add(event.control_key)

    # -- views -----------------------------------------------------------------
    @property
    def in_force(self) -> Mapping[str, ControlEvent]:
        return self._in_force

    def breakers(self) -> dict[str, BreakerStatus]:
        statuses = {w.scope: w.breaker.status for w in self._workers.values()}
        statuses[self.scope] = self._breaker.status
        return statuses

    def lost_workers(self) -> dict[str, float]:
        """Per worker scope, since when its heartbeat is lost."""
        return {w.scope: w.lost_since for w in self._workers.values() if w.lost_since is not None}

    @property
    def degradation(self) -> DegradationStatus:
        return self._ladder.status

    def arm(self, now: float, window_s: float) -> Arm:
        """The pool as one arm of a canary comparison: its finished requests over the
        last ``window_s`` (at most the request window), its workers still reporting,
        and whether its breaker is open."""
        stats = self._requests.stats(now, min(window_s, self._requests.size_s))
        shadows = self._mismatches.stats(now, min(window_s, self._mismatches.config.share.window_s))
        return Arm(
            requests=stats.count,
            errors=stats.errors,
            p99_ms=stats.p99_ms,
            ttft_ms=stats.ttft_mean_ms,
            consistency_checks=shadows.total,
            consistency_mismatches=shadows.hits,
            workers=sum(1 for w in self._workers.values() if w.lost_since is None),
            breaker_open=self._breaker.status.circuit is Circuit.OPEN,
        )

    def batch_limits(self) -> dict[str, tuple[int, float | None]]:
        """Per worker id: the limit in force and the latency EWMA behind it."""
        return {
            w.id: (w.batch.limit, w.batch.ewma_ms)
            for w in self._workers.values()
            if w.batch is not None
        }

    # -- telemetry -------------------------------------------------------------
    def observe(self, event: TelemetryEvent, now: float) -> Output:
        now = self._advance(now)
        known = self._workers.get(f"worker:{event.worker_id}")
        if known is not None and not self._current(known, event.at, now):
            return Output(stale=True)
        heartbeat = event.heartbeat if isinstance(event, WorkerReport) else event
        if isinstance(heartbeat, WorkerHeartbeat) and heartbeat.status == "stopped":
            self._forget(f"worker:{event.worker_id}")
            return self._output()
        incarnation = heartbeat.incarnation if isinstance(heartbeat, WorkerHeartbeat) else None
        worker = self._worker(event.worker_id, now, incarnation)
        if known is None:
            self._current(worker, event.at, now)  # its first report anchors its clock
        self._observed.add(worker.scope)
        if isinstance(event, WorkerReport):
            for part in event.parts():
                self._on_reading(worker, part, now)
            if event.requests is not None and event.requests.count:
                self._on_requests(worker, event.requests, now)
            if event.requests is not None and event.requests.consistency_checks:
                checks = event.requests.consistency_checks
                mismatches = min(event.requests.consistency_mismatches, checks)
                self._mismatches.record(now, checks, mismatches)
        else:
            self._on_reading(worker, event, now)
        return self._output()

    def _on_reading(
        self, worker: _Worker, event: EngineStats | GpuStats | WorkerHeartbeat, now: float
    ) -> None:
        if isinstance(event, EngineStats):
            self._on_engine_stats(worker, event, now)
        elif isinstance(event, GpuStats):
            if worker.memory_reserved is not None:
                headroom = memory_headroom_pct(
                    event.memory_used_bytes, event.memory_total_bytes, worker.memory_reserved
                )
                worker.gpu_memory.record(now, headroom)
                self._gpu_memory.record(now, headroom)
            self._gpu_temperature.record(now, event.temperature_c)
        else:
            if self.config.host_cpu_breaker:
                worker.cpu.record(now, event.host_cpu_pct)
                self._cpu.record(now, event.host_cpu_pct)
            worker.incarnation = event.incarnation
            back = self._monitor.beat(worker.scope, now)
            if back is not None:
                worker.lost_since = None
                self._breaker_decision(worker.breaker.on_liveness(back))

    def _on_requests(self, worker: _Worker, summary: RequestSummary, now: float) -> None:
        """A report interval's finished requests: into the windows, the batch limit and
        the half-open probes."""
        latencies = ddsketch_of(summary.latency)
        self._long_prompts.record(now, summary.count, summary.long_prompts)
        worker.requests.record_many(now, latencies, summary.errors)
        self._requests.record_many(
            now, latencies, summary.errors, summary.ttft_count, summary.ttft_sum_ms
        )
        if worker.batch is not None:
            decision = worker.batch.observe(now, samples_of(summary))
            if decision is not None:
                self._issue_batch(worker, decision.evidence, str(decision.previous_state), now)
        passed = summary.count - summary.errors
        for breaker in (worker.breaker, self._breaker):
            self._breaker_decision(breaker.record_probes(now, passed, summary.errors))

    def _on_engine_stats(self, worker: _Worker, event: EngineStats, now: float) -> None:
        worker.memory_reserved = event.limits.gpu_memory_utilization
        # a total that went down is an engine that restarted: a new count, not preemptions
        previous_total, worker.preempted_total = worker.preempted_total, event.preempted_total
        preempted = 0 if previous_total is None else max(0, event.preempted_total - previous_total)
        self._preemptions.record(now, preempted)
        self._kv_usage.record(now, event.kv_cache_usage)
        self._waiting.record(now, event.waiting)
        batch = self._batch_for(worker, event, now)
        decision = batch.observe_engine(now, preempted, event.waiting, event.kv_cache_usage)
        if decision is not None:
            self._issue_batch(worker, decision.evidence, str(decision.previous_state), now)

    def _batch_for(self, worker: _Worker, event: EngineStats, now: float) -> AdaptiveBatchLimit:
        """The worker's batch limit, made (or remade) for its engine's ``max_num_seqs``."""
        max_num_seqs = event.limits.max_num_seqs
        if worker.batch is not None and worker.max_num_seqs == max_num_seqs:
            return worker.batch
        previous = worker.batch.limit if worker.batch is not None else None
        worker.max_num_seqs = max_num_seqs
        batch = worker.batch = AdaptiveBatchLimit(
            worker.scope,
            max_num_seqs,
            self.config.batch,
            event.batch_limit if previous is None else previous,
        )
        self._dirty.add(worker.scope)
        if previous == batch.limit:
            return batch
        evidence = PolicyEvidence(
            reason=(
                f"engine max_num_seqs {max_num_seqs}: limit {batch.limit} "
                f"(the worker ran {event.batch_limit})"
            ),
            metrics={"reported_batch_limit": event.batch_limit, "in_flight": event.in_flight},
            thresholds={"max_num_seqs": max_num_seqs, "floor": batch.floor, "cap": batch.cap},
        )
        self._issue_batch(worker, evidence, None if previous is None else str(previous), now)
        return batch

    def _current(self, worker: _Worker, at: float, now: float) -> bool:
        """Whether a report of the worker is current; a moved anchor is persisted with
        the worker's record (a restarted controller judges its backlog by it)."""
        before = worker.clock.anchor_at, worker.clock.anchor_now
        current = worker.clock.current(at, now)
        if (worker.clock.anchor_at, worker.clock.anchor_now) != before:
            self._dirty.add(worker.scope)
        return current

    def _worker(self, worker_id: str, now: float, incarnation: str | None = None) -> _Worker:
        """The worker, first seen now unless known (``incarnation``: its heartbeat's, if
        the record holds one, so that even its first decision names it)."""
        scope = f"worker:{worker_id}"
        worker = self._workers.get(scope)
        if worker is None:
            worker = self._workers[scope] = _Worker(worker_id, self.config)
            worker.incarnation = incarnation
            self._monitor.beat(scope, now)
            evidence = PolicyEvidence(reason=f"worker {worker_id} first seen in pool {self.pool}")
            self._issue_breaker(scope, BreakerStatus(), evidence, None, now)
        return worker

    def _forget(self, scope: str) -> None:
        """A worker that left: no decision about it is re-published any more."""
        if self._workers.pop(scope, None) is None:
            return
        self._monitor.forget(scope)
        self.inputs.pop(scope, None)
        for key in self._keys_by_scope.pop(scope, ()):
            del self._in_force[key]
        self._dirty.add(scope)

    # -- time ------------------------------------------------------------------
    def tick(self, now: float) -> Output:
        """Evaluate every scope, detect heartbeat loss, forget workers long lost, and
        re-publish the decisions in force when due."""
        now = self._advance(now)
        for lost in self._monitor.check(now):
            worker = self._workers[lost.scope]
            worker.lost_since = now
            self._breaker_decision(worker.breaker.on_liveness(lost))
        forget_after_s = self.config.forget_after_s
        for worker in list(self._workers.values()):
            if worker.lost_since is not None and now - worker.lost_since > forget_after_s:
                self._forget(worker.scope)
        return self._evaluate(now, list(self._workers.values()))

    def react(self, now: float) -> Output:
        """Evaluate the pool and the workers that sent telemetry since the last
        evaluation: what a record can change at once. A worker's holds that run out
        without telemetry wait for the next ``tick`` (a second at most, by default), so
        that reacting to a record costs its worker, not the whole pool."""
        now = self._advance(now)
        workers = [self._workers[s] for s in self._observed if s in self._workers]
        return self._evaluate(now, workers)

    def _evaluate(self, now: float, workers: list[_Worker]) -> Output:
        cfg = self.config
        self._observed.clear()
        for worker in workers:
            readings = breaker_readings(
                cfg.breaker, now, worker.requests, worker.cpu, worker.gpu_memory
            )
            self.inputs[worker.scope] = _values(readings)
            self._breaker_decision(worker.breaker.evaluate(now, readings))
        readings = breaker_readings(cfg.breaker, now, self._requests, self._cpu, self._gpu_memory)
        rungs = degradation_readings(
            cfg.degradation, now, self._requests, self._gpu_temperature, self._preemptions
        )
        engine_window = cfg.degradation.preemptions_per_s.window_s
        self.inputs[self.scope] = {
            **_values(readings),
            **_values(
                {
                    "kv_cache_usage": self._kv_usage.stats(now, engine_window).mean_reading(),
                    "engine_waiting": self._waiting.stats(now, engine_window).mean_reading(),
                }
            ),
            **{f"ladder.{k}": v for k, v in _values(rungs).items()},
        }
        self._breaker_decision(self._breaker.evaluate(now, readings))
        ladder = self._ladder.evaluate(now, rungs)
        if ladder is not None:
            previous = describe_degradation(ladder.previous_state)
            self._issue_degradation(ladder.new_state, ladder.evidence, previous, now)
        self.long_prompts = _latched(self._long_prompts.evaluate(now), self.long_prompts)
        self.output_mismatches = _latched(self._mismatches.evaluate(now), self.output_mismatches)
        republished: tuple[ControlEvent, ...] = ()
        if now - self._last_republish >= cfg.republish_s:
            self._last_republish = now
            republished = tuple(self._republish(e, now) for e in list(self._in_force.values()))
        return self._output(republished)

    def _advance(self, now: float) -> float:
        self._now = max(self._now, now)
        return self._now

    def _next_seq(self, now: float) -> int:
        self._seq = max(self._seq + 1, int(now * 1_000_000))
        return self._seq

    def _output(self, republished: tuple[ControlEvent, ...] = ()) -> Output:
        changes, self._changes = tuple(self._changes), []
        return Output(changes=changes, republished=republished)

    # -- events ----------------------------------------------------------------
    def _emit(self, event: ControlEvent) -> None:
        self._set_in_force(event)
        self._changes.append(event)
        self._dirty.add(event.scope)

    def _republish(self, event: ControlEvent, now: float) -> ControlEvent:
        again = republished(event, now, self._next_seq(now), self.config.valid_for_s)
        self._in_force[event.control_key] = again
        return again

    def _breaker_decision(self, decision: Decision[BreakerStatus] | None) -> None:
        if decision is not None:
            previous = describe_breaker(decision.previous_state)
            self._issue_breaker(
                decision.scope, decision.new_state, decision.evidence, previous, decision.at
            )

    def _issue_breaker(
        self,
        scope: str,
        status: BreakerStatus,
        evidence: PolicyEvidence,
        previous: str | None,
        now: float,
    ) -> None:
        worker = self._workers.get(scope)
        self._emit(
            BreakerState(
                scope=scope,
                seq=self._next_seq(now),
                issued_at=now,
                valid_for_s=self.config.valid_for_s,
                evidence=wire_evidence(evidence, previous),
                state=status.circuit.value,
                level=status.level,
                tripped=status.tripped,
                probe_requests=status.probe_requests,
                incarnation=None if worker is None else worker.incarnation,
            )
        )

    def _issue_degradation(
        self,
        status: DegradationStatus,
        evidence: PolicyEvidence,
        previous: str | None,
        now: float,
    ) -> None:
        cfg = self.config
        diverts = status.level >= 1 and self.pool != cfg.small_pool
        self._emit(
            DegradationLevel(
                scope=self.scope,
                seq=self._next_seq(now),
                issued_at=now,
                valid_for_s=cfg.valid_for_s,
                evidence=wire_evidence(evidence, previous),
                level=status.level,
                small_pool=cfg.small_pool if diverts else None,
                max_tokens_cap=cfg.max_tokens_cap if status.level >= 2 else None,
            )
        )

    def _issue_batch(
        self, worker: _Worker, evidence: PolicyEvidence, previous: str | None, now: float
    ) -> None:
        assert worker.batch is not None
        self._emit(
            BatchLimit(
                scope=worker.scope,
                seq=self._next_seq(now),
                issued_at=now,
                valid_for_s=self.config.valid_for_s,
                evidence=wire_evidence(evidence, previous),
                worker_id=worker.id,
                limit=min(1024, worker.batch.limit),
            )
        )
