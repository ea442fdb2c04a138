"""The controller's decider for one pool: telemetry in, control events out. Pure: no
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

The decisions in force, their records and how they are issued and re-published:
``PoolState`` (``state``), which ``PoolDecider`` extends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from schemas import (
    ControlEvent,
    EngineStats,
    GpuStats,
    RequestSummary,
    TelemetryEvent,
    WorkerHeartbeat,
    WorkerReport,
)
from services.common.sketch import ddsketch_of
from services.controller.decider.evidence import describe_degradation, latched
from services.controller.decider.state import PoolState, WorkerState
from services.controller.policy import (
    AdaptiveBatchLimit,
    BreakerStatus,
    Reading,
    Samples,
    breaker_readings,
    degradation_readings,
)
from services.controller.policy import Evidence as PolicyEvidence

K = TypeVar("K", bound=str)


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


class PoolDecider(PoolState):
    """The decisions for one pool and its workers (see the module docstring)."""

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
        self, worker: WorkerState, event: EngineStats | GpuStats | WorkerHeartbeat, now: float
    ) -> None:
        if isinstance(event, EngineStats):
            self._on_engine_stats(worker, event, now)
        elif isinstance(event, GpuStats):
            # This worker's own processes' memory where known: another process on the
            # same GPU must not restart this worker. A figure not reported is not judged.
            used = event.process_memory_bytes
            if used is None:
                used = event.memory_used_bytes
            total = event.memory_total_bytes
            if worker.memory_reserved is not None and used is not None and total is not None:
                headroom = memory_headroom_pct(used, total, worker.memory_reserved)
                worker.gpu_memory.record(now, headroom)
                self._gpu_memory.record(now, headroom)
            if event.temperature_c is not None:
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

    def _on_requests(self, worker: WorkerState, summary: RequestSummary, now: float) -> None:
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

    def _on_engine_stats(self, worker: WorkerState, event: EngineStats, now: float) -> None:
        worker.memory_reserved = event.limits.gpu_memory_utilization
        worker.stalled.record(now, event.stalled_s)
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

    def _batch_for(self, worker: WorkerState, event: EngineStats, now: float) -> AdaptiveBatchLimit:
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

    def _current(self, worker: WorkerState, at: float, now: float) -> bool:
        """Whether a report of the worker is current; an anchor that moved from the
        saved one by more than the freshness policy's tolerance is persisted with the
        worker's record (a restarted controller judges its backlog by it)."""
        current = worker.clock.current(at, now)
        if worker.clock.moved_from(worker.saved_anchor):
            self._dirty.add(worker.scope)
        return current

    def _worker(self, worker_id: str, now: float, incarnation: str | None = None) -> WorkerState:
        """The worker, first seen now unless known (``incarnation``: its heartbeat's, if
        the record holds one, so that even its first decision names it)."""
        scope = f"worker:{worker_id}"
        worker = self._workers.get(scope)
        if worker is None:
            worker = self._workers[scope] = WorkerState(worker_id, self.config)
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

    def _evaluate(self, now: float, workers: list[WorkerState]) -> Output:
        cfg = self.config
        self._observed.clear()
        for worker in workers:
            readings = breaker_readings(
                cfg.breaker, now, worker.requests, worker.cpu, worker.gpu_memory, worker.stalled
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
        self.long_prompts = latched(self._long_prompts.evaluate(now), self.long_prompts)
        self.output_mismatches = latched(self._mismatches.evaluate(now), self.output_mismatches)
        republished: tuple[ControlEvent, ...] = ()
        if now - self._last_republish >= cfg.republish_s:
            self._last_republish = now
            republished = tuple(self._republish(e, now) for e in list(self._in_force.values()))
        return self._output(republished)

    def _advance(self, now: float) -> float:
        self._now = max(self._now, now)
        return self._now

    def _output(self, republished: tuple[ControlEvent, ...] = ()) -> Output:
        changes, self._changes = tuple(self._changes), []
        return Output(changes=changes, republished=republished)
