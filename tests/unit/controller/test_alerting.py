"""What in a pool's state becomes an alert condition, with the evidence behind it."""

from __future__ import annotations

import pytest

from schemas import BreakerState, EngineStats, WorkerReport
from services.controller.alerting import conditions
from services.controller.decider.config import DeciderConfig
from services.controller.policy import HeartbeatConfig
from services.workers.policy.summary import RequestSummarizer
from tests.unit.controller.decider.test_pool import T0, Fleet, engine_stats, gpu, heartbeat

pytestmark = pytest.mark.unit


def rules(fleet: Fleet) -> dict[tuple[str, str], str]:
    """(rule, scope) → severity."""
    return {(c.rule, c.scope): c.severity for c in conditions(fleet.decider)}


def test_a_healthy_pool_raises_nothing() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.serve("w1", 40)
    fleet.tick()
    assert conditions(fleet.decider) == []


def test_tripped_breakers_and_the_ladder_raise_alerts_with_their_decisions_evidence() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.serve("w1", 40, errors=20)
    fleet.tick()
    assert rules(fleet) == {
        ("breaker_open", "worker:w1"): "warning",
        ("breaker_open", "pool:main"): "critical",  # the pool refuses new work
        ("degradation", "pool:main"): "warning",  # level 2
    }
    pool = next(c for c in conditions(fleet.decider) if c.scope == "pool:main")
    in_force = fleet.decider.in_force["breaker/pool:main"]
    assert isinstance(in_force, BreakerState)
    assert pool.evidence == in_force.evidence
    assert pool.evidence.metrics["error_rate"] == pytest.approx(0.5)
    assert "open" in pool.summary
    assert "error_rate" in pool.summary


def test_a_lost_worker_is_one_heartbeat_alert_not_also_a_breaker_alert() -> None:
    fleet = Fleet(DeciderConfig(heartbeat=HeartbeatConfig(timeout_s=10.0)))
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0))
    fleet.tick(advance=5.0)
    fleet.feed(heartbeat("w2", fleet.now))
    fleet.tick(advance=6.0)
    assert rules(fleet) == {("heartbeat_lost", "worker:w1"): "warning"}
    (lost,) = conditions(fleet.decider)
    assert lost.evidence.metrics["heartbeat_age_s"] == pytest.approx(11.0)


def test_the_static_fallback_rung_is_critical() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), gpu("w1", T0, temperature_c=91.0))
    fleet.tick()
    assert rules(fleet) == {("degradation", "pool:main"): "critical"}


def report_of(at: float, summary: RequestSummarizer) -> WorkerReport:
    """Worker w1's report at ``at`` with what ``summary`` counted since a second before."""
    return WorkerReport(
        worker_id="w1", pool="main", at=at, heartbeat=heartbeat("w1", at), requests=summary.take(at)
    )


def long_prompt_report(at: float, long: int, short: int) -> WorkerReport:
    summary = RequestSummarizer(at - 1.0)
    for tokens in [5000] * long + [100] * short:
        summary.add(50.0, ok=True, prompt_tokens=tokens, completion_tokens=10)
    return report_of(at, summary)


def test_the_long_prompt_share_raises_an_alert_that_decays_when_traffic_stops() -> None:
    fleet = Fleet()
    fleet.feed(long_prompt_report(T0, long=10, short=20))
    fleet.tick()
    (alert,) = conditions(fleet.decider)
    assert (alert.rule, alert.scope, alert.severity) == (
        "long_prompt_share",
        "pool:main",
        "warning",
    )
    assert alert.evidence.metrics["long_prompt_share"] == pytest.approx(10 / 30)
    assert alert.evidence.thresholds["long_prompt_tokens"] == 4096
    assert "33%" in alert.summary
    for _ in range(40):  # the workers keep beating, nobody sends prompts
        fleet.feed(heartbeat("w1", fleet.now))
        fleet.tick(advance=10.0)
    assert conditions(fleet.decider) == []


def shadow_report(at: float, checks: int, mismatches: int) -> WorkerReport:
    summary = RequestSummarizer(at - 1.0)
    for n in range(checks):
        summary.add_consistency(agrees=n >= mismatches, similarity=0.4 if n < mismatches else 1.0)
    return report_of(at, summary)


def test_shadow_runs_that_disagree_raise_an_alert_that_clears_when_they_agree_again() -> None:
    fleet = Fleet()
    fleet.feed(shadow_report(T0, checks=12, mismatches=6))
    fleet.tick()
    (alert,) = conditions(fleet.decider)
    assert (alert.rule, alert.scope, alert.severity) == (
        "output_inconsistency",
        "pool:main",
        "warning",
    )
    assert alert.evidence.metrics["output_mismatch_rate"] == pytest.approx(0.5)
    assert "50%" in alert.summary
    for _ in range(40):  # every shadow agrees from now on
        fleet.feed(shadow_report(fleet.now, checks=5, mismatches=0))
        fleet.tick(advance=10.0)
    assert conditions(fleet.decider) == []


def test_shadow_runs_that_agree_raise_nothing() -> None:
    fleet = Fleet()
    fleet.feed(shadow_report(T0, checks=50, mismatches=2))
    fleet.tick()
    assert conditions(fleet.decider) == []


def test_a_stalled_engine_isolates_its_worker_with_one_critical_alert_until_it_produces() -> None:
    """A worker reporting requests in flight and no token for over 10 s: its breaker
    opens on ``engine_stalled_s`` (level 3: isolated), one ``engine_stalled`` alert
    (not also ``breaker_open``); tokens again, held 10 s: half-open, the alert gone."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0))
    fleet.feed(stalled("w1", T0, 4.0), stalled("w2", T0, 0.0))
    fleet.tick()
    assert rules(fleet) == {}
    fleet.tick(advance=8.0)
    fleet.feed(stalled("w1", fleet.now, 12.0), heartbeat("w1", fleet.now))
    fleet.tick()
    assert rules(fleet) == {("engine_stalled", "worker:w1"): "critical"}
    state = fleet.decider.in_force["breaker/worker:w1"]
    assert isinstance(state, BreakerState)
    assert (state.state, state.tripped) == ("open", ("engine_stalled_s",))
    assert state.level >= 3
    assert state.evidence.metrics["engine_stalled_s"] == 12.0
    for _ in range(4):  # producing again, reported every 4 s: past the 10 s hold
        fleet.feed(stalled("w1", fleet.now, 0.0), heartbeat("w1", fleet.now))
        fleet.tick(advance=4.0)
    after = fleet.decider.in_force["breaker/worker:w1"]
    assert isinstance(after, BreakerState)
    assert after.state == "half_open"
    assert ("engine_stalled", "worker:w1") not in rules(fleet)


def stalled(worker: str, at: float, seconds: float) -> EngineStats:
    return engine_stats(worker, at).model_copy(update={"stalled_s": seconds})
