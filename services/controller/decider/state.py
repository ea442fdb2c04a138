"""The state of one pool's decider: the decisions in force for the pool and its
workers, how a decision is issued and published again, and what is read of them.

Restart safety: ``records()`` is what the shell persists: a ``PoolRecord`` (the pool's
own decisions and the sequence) and a ``WorkerRecord`` per worker (its decisions and
its engine's ``max_num_seqs``), so that a change costs one small record whatever the
size of the pool; ``take_records()`` returns only the records changed since its last
call. A ``PoolDecider`` built from them re-publishes those decisions at its first
``tick`` and seeds the policies from them, so that a tripped breaker stays open until
its recovery condition holds again in full and a batch limit continues from its last
value. The windows refill from fresh telemetry.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from schemas import BatchLimit, BreakerState, ControlEvent, DegradationLevel, Evidence
from services.controller.decider.config import DeciderConfig
from services.controller.decider.evidence import describe_breaker, republished, wire_evidence
from services.controller.decider.records import PoolRecord, Records, WorkerRecord
from services.controller.policy import (
    AdaptiveBatchLimit,
    Breaker,
    BreakerStatus,
    Circuit,
    Decision,
    DegradationLadder,
    DegradationStatus,
    HeartbeatMonitor,
    Liveness,
)
from services.controller.policy import Evidence as PolicyEvidence
from services.controller.policy.breaker import HEARTBEAT
from services.controller.policy.canary import Arm
from services.controller.policy.freshness import WorkerClock
from services.controller.policy.shares import LONG_PROMPTS, OUTPUT_MISMATCHES, ShareAlert


class WorkerState:
    """One worker of the pool: its windows, breaker and batch limit, and what is known of
    its process and engine."""

    def __init__(self, worker_id: str, config: DeciderConfig) -> None:
        self.id = worker_id
        self.scope = f"worker:{worker_id}"
        self.requests = config.request_window()
        self.cpu = config.gauge_window()
        self.gpu_memory = config.gauge_window()
        self.stalled = config.gauge_window()
        """How long its engine has produced nothing while holding requests, per report."""
        self.breaker = Breaker(self.scope, config.breaker)
        self.batch: AdaptiveBatchLimit | None = None
        self.max_num_seqs: int | None = None
        self.lost_since: float | None = None
        self.preempted_total: int | None = None
        self.clock = WorkerClock(config.max_telemetry_age_s)
        """Whether its reports are current (``policy.freshness``: no clock compared)."""
        self.saved_anchor: tuple[float, float] | None = None
        """The clock's anchor as the worker's record last held it (taken or restored)."""
        self.incarnation: str | None = None
        """The process last heard from under this id (its heartbeats say)."""
        self.memory_reserved: float | None = None
        """The engine's ``gpu_memory_utilization``, from its ``EngineStats``; until one
        arrives (telemetry of different kinds can come out of order, e.g. from a backlog
        read at start) GPU memory is not judged at all."""


class PoolState:
    """The decisions in force for one pool and its workers, with the policies and
    windows behind them; ``PoolDecider`` (``pool``) feeds them telemetry and time."""

    def __init__(
        self,
        pool: str,
        config: DeciderConfig,
        now: float,
        record: PoolRecord | None = None,
        workers: Iterable[WorkerRecord] = (),
    ) -> None:
        """``record`` and ``workers``: what an earlier decider persisted for the pool
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
        self._workers: dict[str, WorkerState] = {}
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
        self._mismatches = ShareAlert(OUTPUT_MISMATCHES.on(config.output_mismatch_rate), self.scope)
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
            worker = self._workers[f"worker:{saved.worker_id}"] = WorkerState(
                saved.worker_id, self.config
            )
            worker.max_num_seqs = saved.max_num_seqs
            if saved.clock_anchor is not None:
                worker.clock.anchor_at, worker.clock.anchor_now = saved.clock_anchor
                worker.saved_anchor = saved.clock_anchor
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
        """Every record of the pool (what a restarted decider is built from)."""
        return self._records([self.scope, *self._workers])

    def take_records(self) -> Records:
        """The records changed since the last call (what the shell persists); falsy if
        none did."""
        dirty, self._dirty = self._dirty, set()
        records = self._records(dirty)
        for worker_id, record in records.workers.items():
            if record is not None:
                self._workers[f"worker:{worker_id}"].saved_anchor = record.clock_anchor
        return records

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

    # -- events ----------------------------------------------------------------
    def _next_seq(self, now: float) -> int:
        self._seq = max(self._seq + 1, int(now * 1_000_000))
        return self._seq

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
        self, worker: WorkerState, evidence: PolicyEvidence, previous: str | None, now: float
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
