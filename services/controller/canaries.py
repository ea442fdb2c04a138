"""Canary releases in the controller (the imperative shell of ``policy.canary``).

An operator's ``CanaryRelease`` (``seawall canary``) reaches every controller instance
on the control topic; the instance that owns the pool runs the release. Each tick it
measures the two arms — the pool's decider and the canary pool's
(``<pool>.canary-<version>``, partitioned with its base pool so that one instance holds
both) — lets ``CanaryJudge`` decide, and publishes the pool's ``TrafficSplit``: on each
change with the evidence, and re-published while the command is in force
(level-triggered), with the phase and step, so that the pool's next owner resumes the
release where it stood. A rollback is an alert (``canary_rollback``) until an operator
aborts the release or starts another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from schemas import CanaryRelease, Evidence, TrafficSplit
from seawall_client.topics import canary_pool
from services.common.control_state import ControlState
from services.controller.decider.evidence import republished, wire_evidence
from services.controller.decider.pool import PoolDecider
from services.controller.policy.alerts import Condition
from services.controller.policy.canary import Arm, CanaryConfig, CanaryJudge, CanaryStatus
from services.controller.policy.canary import started as canary_started
from services.controller.policy.decision import Decision
from services.controller.policy.decision import Evidence as PolicyEvidence

log = logging.getLogger(__name__)


def config_of(command: CanaryRelease, check_timeout_s: float) -> CanaryConfig:
    return CanaryConfig(
        steps=command.steps,
        hold_s=command.hold_s,
        check_s=command.check_s,
        check_timeout_s=max(command.check_s, check_timeout_s),
        min_requests=command.min_requests,
        max_error_rate_delta=command.max_error_rate_delta,
        max_latency_ratio=command.max_latency_ratio,
        max_ttft_ratio=command.max_ttft_ratio,
        max_mismatch_rate_delta=command.max_mismatch_rate_delta,
    )


def weights(pool: str, version: str, share: float) -> dict[str, float]:
    """The pool's traffic split for the canary's ``share`` (no zero entries)."""
    canary = canary_pool(pool, version)
    if share <= 0.0:
        return {pool: 1.0}
    if share >= 1.0:
        return {canary: 1.0}
    return {pool: 1.0 - share, canary: share}


def reference_of(evidence: Evidence) -> Arm | None:
    """The baseline a published split was judged against (its evidence's numbers)."""
    m = evidence.metrics
    if "baseline_requests" not in m:
        return None
    requests = int(m["baseline_requests"])
    checks = int(m.get("baseline_consistency_checks", 0))
    return Arm(
        requests=requests,
        errors=round(m.get("baseline_error_rate", 0.0) * requests),
        p99_ms=m.get("baseline_p99_ms"),
        ttft_ms=m.get("baseline_ttft_ms"),
        workers=int(m.get("baseline_workers", 0)),
        consistency_checks=checks,
        consistency_mismatches=round(m.get("baseline_mismatch_rate", 0.0) * checks),
    )


@dataclass
class _Run:
    command: CanaryRelease
    judge: CanaryJudge
    status: CanaryStatus
    published: TrafficSplit
    sent_at: float


class CanaryReleases:
    """The releases this instance runs, one per pool it owns that has a command in
    force."""

    def __init__(self, *, valid_for_s: float, republish_s: float, check_timeout_s: float) -> None:
        self.valid_for_s = valid_for_s
        self.republish_s = republish_s
        self.check_timeout_s = check_timeout_s
        self.runs: dict[str, _Run] = {}
        self._seq = 0

    def evaluate(
        self,
        control: ControlState,
        deciders: Mapping[str, PoolDecider],
        owned: Callable[[str], bool],
        now: float,
    ) -> list[TrafficSplit]:
        """The splits to publish now: changes and re-publications."""
        out: list[TrafficSplit] = []
        commands = {c.pool: c for c in control.all(CanaryRelease)}
        for pool in [p for p in self.runs if p not in commands or not owned(p)]:
            del self.runs[pool]  # the command ran out, or the pool moved
        for pool, command in commands.items():
            if not owned(pool):
                continue
            run = self.runs.get(pool)
            if run is None or run.command.release != command.release:
                run, first = self._begin(command, control.get(TrafficSplit, f"pool:{pool}"), now)
                self.runs[pool] = run
                if first is not None:
                    out.append(first)
            run.command = command
            decision = None
            if command.action != "start":
                decision = run.judge.command(run.status, command.action, now)
            if decision is None:
                window = command.hold_s
                baseline = self._arm(deciders, pool, now, window)
                canary = self._arm(deciders, canary_pool(pool, command.version), now, window)
                run.status, decision = run.judge.evaluate(run.status, baseline, canary, now)
            if decision is not None:
                out.append(self._issue(run, decision, now))
            elif now - run.sent_at >= self.republish_s:
                out.append(self._republish(run, now))
        return out

    def conditions(self) -> list[Condition]:
        """A ``canary_rollback`` alert per release rolled back (until aborted)."""
        return [
            Condition(
                "canary_rollback",
                f"pool:{pool}",
                pool,
                "critical",
                f"the canary {run.command.version} of pool {pool} was rolled back: "
                f"{run.published.evidence.reason}",
                run.published.evidence,
            )
            for pool, run in self.runs.items()
            if run.status.phase == "rolled_back"
        ]

    # -- internals -----------------------------------------------------------------
    @staticmethod
    def _arm(deciders: Mapping[str, PoolDecider], pool: str, now: float, window: float) -> Arm:
        decider = deciders.get(pool)
        return Arm() if decider is None else decider.arm(now, window)

    def _begin(
        self, command: CanaryRelease, last: TrafficSplit | None, now: float
    ) -> tuple[_Run, TrafficSplit | None]:
        """A release this instance has not run: resumed from the pool's last split if
        that was this release's, else started (with the split that says so)."""
        config = config_of(command, self.check_timeout_s)
        judge = CanaryJudge(f"pool:{command.pool}", config, command.hold_s)
        if last is not None and last.release == command.release and last.phase is not None:
            status = CanaryStatus(
                last.phase, last.step, last.since or now, reference_of(last.evidence)
            )
            log.info(
                "canary release resumed",
                extra={"pool": command.pool, "version": command.version, "phase": last.phase},
            )
            return _Run(command, judge, status, last, now), None
        status = canary_started(now)
        evidence = PolicyEvidence(
            reason=f"canary {command.version} started: checking its workers before any traffic",
            thresholds={"check_s": config.check_s, "hold_s": config.hold_s},
        )
        split = self._split(command, judge, status, wire_evidence(evidence, None), now)
        log.warning(
            "canary release started", extra={"pool": command.pool, "version": command.version}
        )
        return _Run(command, judge, status, split, now), split

    def _split(
        self,
        command: CanaryRelease,
        judge: CanaryJudge,
        status: CanaryStatus,
        evidence: Evidence,
        now: float,
    ) -> TrafficSplit:
        return TrafficSplit(
            scope=f"pool:{command.pool}",
            seq=self._next_seq(now),
            issued_at=now,
            valid_for_s=self.valid_for_s,
            evidence=evidence,
            pool=command.pool,
            weights=weights(command.pool, command.version, status.share(judge.config)),
            version=command.version,
            release=command.release,
            phase=status.phase,
            step=status.step,
            since=status.since,
        )

    def _issue(self, run: _Run, decision: Decision[CanaryStatus], now: float) -> TrafficSplit:
        config = run.judge.config
        run.status = decision.new_state
        previous = decision.previous_state.describe(config)
        split = self._split(
            run.command, run.judge, run.status, wire_evidence(decision.evidence, previous), now
        )
        run.published, run.sent_at = split, now
        log.log(
            logging.ERROR if run.status.phase == "rolled_back" else logging.WARNING,
            "canary release " + run.status.describe(config),
            extra={
                "pool": run.command.pool,
                "version": run.command.version,
                "reason": decision.evidence.reason,
            },
        )
        return split

    def _republish(self, run: _Run, now: float) -> TrafficSplit:
        run.published = republished(run.published, now, self._next_seq(now), self.valid_for_s)
        run.sent_at = now
        return run.published

    def _next_seq(self, now: float) -> int:
        self._seq = max(self._seq + 1, int(now * 1_000_000))
        return self._seq
