"""A canary release of a pool's new model version: check, ramp, promote or roll back.

DESIGN (seed 2): new version → A/B check → 5 % of the traffic → widen step by step to
100 % while the canary's metrics stay within bounds of the baseline; otherwise roll back
and alert. The canary's workers serve a pool of their own (``<pool>.canary-<version>``),
so the two *arms* — the pool's own workers (baseline) and the canary's — are measured
apart over the same window and compared here.

Phases (``CanaryStatus.phase``):

- ``checking`` — no traffic yet. Passes once the canary has reported workers with its
  breaker closed and ``check_s`` has gone by since the start; rolls back when no worker
  has come ``check_timeout_s`` after the start, or the canary's breaker opens.
- ``ramping`` (step ``i``: the canary takes ``steps[i]`` of the pool's traffic) — the
  arms are compared at every evaluation once the canary's window holds ``min_requests``
  requests: its error rate above the baseline's by more than ``max_error_rate_delta``,
  or its latency P99 / mean TTFT above the baseline's times ``max_latency_ratio`` /
  ``max_ttft_ratio``, or — once it holds ``min_consistency_checks`` shadow comparisons
  — its output mismatch rate above the baseline's by more than
  ``max_mismatch_rate_delta``, rolls back; so does its breaker opening or its workers vanishing.
  After ``hold_s`` on the step with no breach and a full window, the next step; after
  the last (1.0), ``promoted``.
- ``promoted``, ``rolled_back``, ``aborted`` — final. An operator's ``promote`` or
  ``abort`` reaches them from any phase that is not final; an ``abort`` also turns a
  rollback into ``aborted`` (acknowledged: its alert resolves).

The baseline's figures are remembered (``reference``) whenever its window is full: at
100 % (and briefly before) the pool's own workers serve nothing, and the canary is then
held to what they last showed. Pure: no I/O, time passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from schemas.control import check_steps
from services.controller.policy.decision import Decision, DecisionKind, Evidence

Phase = Literal["checking", "ramping", "promoted", "rolled_back", "aborted"]
FINAL: frozenset[Phase] = frozenset({"promoted", "rolled_back", "aborted"})


@dataclass(frozen=True)
class CanaryConfig:
    """A release's terms (``schemas.CanaryRelease`` holds them on the wire)."""

    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    hold_s: float = 300.0
    check_s: float = 30.0
    check_timeout_s: float = 120.0
    min_requests: int = 20
    max_error_rate_delta: float = 0.02
    max_latency_ratio: float = 1.5
    max_ttft_ratio: float = 1.5
    max_mismatch_rate_delta: float = 0.05
    min_consistency_checks: int = 10
    """Shadow comparisons the canary's window needs before its mismatch rate counts."""

    def __post_init__(self) -> None:
        check_steps(self.steps)
        if self.hold_s <= 0 or self.check_s < 0 or self.check_timeout_s < self.check_s:
            raise ValueError("need hold_s > 0 and 0 <= check_s <= check_timeout_s")
        if self.min_requests < 1 or self.max_error_rate_delta < 0:
            raise ValueError("need min_requests >= 1 and max_error_rate_delta >= 0")
        if self.max_latency_ratio < 1 or self.max_ttft_ratio < 1:
            raise ValueError("the latency and TTFT ratios must be at least 1")
        if self.max_mismatch_rate_delta < 0 or self.min_consistency_checks < 1:
            raise ValueError("need max_mismatch_rate_delta >= 0 and min_consistency_checks >= 1")


@dataclass(frozen=True)
class Arm:
    """One arm's figures over the comparison window."""

    requests: int = 0
    errors: int = 0
    p99_ms: float | None = None
    ttft_ms: float | None = None
    """Mean time to first token."""
    workers: int = 0
    """Workers reporting (heartbeats not lost)."""
    breaker_open: bool = False
    consistency_checks: int = 0
    """Shadow runs on this arm compared with the original's output (admission sends the
    shadows of the pool's requests to the canary while it runs)."""
    consistency_mismatches: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def mismatch_rate(self) -> float:
        checks = self.consistency_checks
        return self.consistency_mismatches / checks if checks else 0.0


@dataclass(frozen=True)
class CanaryStatus:
    phase: Phase = "checking"
    step: int = 0
    since: float = 0.0
    """When the phase — or, ramping, the step — began."""
    reference: Arm | None = None
    """The baseline as last seen with a full window."""

    def share(self, config: CanaryConfig) -> float:
        """The canary's share of the pool's traffic in this status."""
        if self.phase == "ramping":
            return config.steps[self.step]
        return 1.0 if self.phase == "promoted" else 0.0

    def describe(self, config: CanaryConfig) -> str:
        if self.phase == "ramping":
            return f"ramping step {self.step + 1}/{len(config.steps)} at {self.share(config):.0%}"
        return self.phase.replace("_", " ")


def started(now: float) -> CanaryStatus:
    return CanaryStatus("checking", 0, now)


def _arm_metrics(prefix: str, arm: Arm) -> dict[str, float]:
    out = {
        f"{prefix}_requests": float(arm.requests),
        f"{prefix}_error_rate": arm.error_rate,
        f"{prefix}_workers": float(arm.workers),
    }
    if arm.p99_ms is not None:
        out[f"{prefix}_p99_ms"] = arm.p99_ms
    if arm.ttft_ms is not None:
        out[f"{prefix}_ttft_ms"] = arm.ttft_ms
    if arm.consistency_checks:
        out[f"{prefix}_consistency_checks"] = float(arm.consistency_checks)
        out[f"{prefix}_mismatch_rate"] = arm.mismatch_rate
    return out


class CanaryJudge:
    """The release of one pool: ``evaluate`` each tick, ``command`` for an operator's."""

    def __init__(self, scope: str, config: CanaryConfig, window_s: float) -> None:
        self.scope = scope
        self.config = config
        self.window_s = window_s

    def _decision(
        self, status: CanaryStatus, new: CanaryStatus, now: float, evidence: Evidence
    ) -> Decision[CanaryStatus]:
        return Decision(self.scope, DecisionKind.CANARY, now, status, new, evidence)

    def command(
        self, status: CanaryStatus, action: Literal["promote", "abort"], now: float
    ) -> Decision[CanaryStatus] | None:
        if status.phase in FINAL and (action, status.phase) != ("abort", "rolled_back"):
            return None  # an abort acknowledges a rollback (its alert resolves)
        phase: Phase = "promoted" if action == "promote" else "aborted"
        new = replace(status, phase=phase, since=now)
        return self._decision(status, new, now, Evidence(reason=f"an operator's {action}"))

    def evaluate(
        self, status: CanaryStatus, baseline: Arm, canary: Arm, now: float
    ) -> tuple[CanaryStatus, Decision[CanaryStatus] | None]:
        """The status after this evaluation (its reference may be refreshed without a
        decision) and the decision, if the phase or step changed."""
        if status.phase in FINAL:
            return status, None
        cfg = self.config
        if baseline.requests >= cfg.min_requests:
            status = replace(status, reference=baseline)
        if status.phase == "checking":
            return status, self._check(status, canary, now)
        return status, self._ramp(status, canary, now)

    def _check(
        self, status: CanaryStatus, canary: Arm, now: float
    ) -> Decision[CanaryStatus] | None:
        cfg = self.config
        waited = now - status.since
        metrics = {"canary_workers": float(canary.workers), "waited_s": waited}
        if canary.breaker_open:
            return self._rollback(status, "the canary's breaker opened during its check", now)
        if canary.workers == 0:
            if waited < cfg.check_timeout_s:
                return None
            return self._rollback(
                status,
                f"no worker of the canary reported within {cfg.check_timeout_s:g} s",
                now,
                thresholds={"waited_s": cfg.check_timeout_s},
            )
        if waited < cfg.check_s:
            return None
        new = replace(status, phase="ramping", step=0, since=now)
        return self._decision(
            status,
            new,
            now,
            Evidence(
                reason=f"check passed: {canary.workers} canary worker(s) reporting, breaker "
                f"closed; first step {cfg.steps[0]:.0%}",
                metrics=metrics,
                thresholds={"waited_s": cfg.check_s},
                hold_s=waited,
            ),
        )

    def breaches(self, reference: Arm | None, canary: Arm) -> tuple[list[str], dict[str, float]]:
        """What the canary breaks against the reference (reasons, and the thresholds
        compared with); nothing while the canary's window holds too few requests."""
        cfg = self.config
        reasons: list[str] = []
        thresholds: dict[str, float] = {}
        if canary.requests < cfg.min_requests:
            return reasons, thresholds
        base_rate = reference.error_rate if reference is not None else 0.0
        limit = base_rate + cfg.max_error_rate_delta
        thresholds["canary_error_rate"] = limit
        if canary.error_rate > limit:
            reasons.append(f"error rate {canary.error_rate:.1%} above {limit:.1%}")
        if canary.consistency_checks >= cfg.min_consistency_checks:
            # While the canary runs, the pool's shadows go to it: the baseline seldom
            # has comparisons of its own, and is then taken as reproducing itself.
            base = reference if reference is not None else Arm()
            known = base.consistency_checks >= cfg.min_consistency_checks
            limit = (base.mismatch_rate if known else 0.0) + cfg.max_mismatch_rate_delta
            thresholds["canary_mismatch_rate"] = limit
            if canary.mismatch_rate > limit:
                reasons.append(f"output mismatch rate {canary.mismatch_rate:.1%} above {limit:.1%}")
        if reference is None:
            return reasons, thresholds
        pairs = (
            ("p99_ms", "latency P99", canary.p99_ms, reference.p99_ms, cfg.max_latency_ratio),
            ("ttft_ms", "mean TTFT", canary.ttft_ms, reference.ttft_ms, cfg.max_ttft_ratio),
        )
        for key, label, mine, theirs, ratio in pairs:
            if mine is None or theirs is None or theirs <= 0:
                continue
            thresholds[f"canary_{key}"] = theirs * ratio
            if mine > theirs * ratio:
                reasons.append(
                    f"{label} {mine:.0f} ms above {ratio:g}x the baseline's {theirs:.0f}"
                )
        return reasons, thresholds

    def _ramp(self, status: CanaryStatus, canary: Arm, now: float) -> Decision[CanaryStatus] | None:
        cfg = self.config
        reasons, thresholds = self.breaches(status.reference, canary)
        if reasons:  # the numbers first: they say why a breaker would have opened
            return self._rollback(status, "; ".join(reasons), now, canary, thresholds)
        if canary.breaker_open:
            return self._rollback(status, "the canary's breaker opened", now, canary)
        if canary.workers == 0:
            return self._rollback(status, "every canary worker is gone", now, canary)
        held = now - status.since
        if held < cfg.hold_s or canary.requests < cfg.min_requests:
            return None
        last = status.step + 1 >= len(cfg.steps)
        new = (
            replace(status, phase="promoted", since=now)
            if last
            else replace(status, step=status.step + 1, since=now)
        )
        reason = (
            "every step held within bounds: promoted"
            if last
            else f"step {status.share(cfg):.0%} held within bounds for {held:.0f} s: "
            f"next {cfg.steps[status.step + 1]:.0%}"
        )
        return self._decision(
            status,
            new,
            now,
            Evidence(
                reason=reason,
                window_s=self.window_s,
                metrics=self._metrics(status, canary),
                thresholds={**thresholds, "canary_requests": float(cfg.min_requests)},
                hold_s=held,
            ),
        )

    def _metrics(self, status: CanaryStatus, canary: Arm) -> dict[str, float]:
        base = _arm_metrics("baseline", status.reference) if status.reference else {}
        return {**base, **_arm_metrics("canary", canary)}

    def _rollback(
        self,
        status: CanaryStatus,
        reason: str,
        now: float,
        canary: Arm | None = None,
        thresholds: dict[str, float] | None = None,
    ) -> Decision[CanaryStatus]:
        new = replace(status, phase="rolled_back", since=now)
        return self._decision(
            status,
            new,
            now,
            Evidence(
                reason=f"rolled back at {status.describe(self.config)}: {reason}",
                window_s=self.window_s,
                metrics=self._metrics(status, canary or Arm()),
                thresholds=thresholds or {},
                hold_s=now - status.since,
            ),
        )
