"""The canary release's state machine (``policy.canary``): each phase's way out, and
properties over any sequence of evaluations (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.policy.canary import (
    FINAL,
    Arm,
    CanaryConfig,
    CanaryJudge,
    CanaryStatus,
    started,
)
from services.controller.policy.decision import DecisionKind

CFG = CanaryConfig(
    steps=(0.05, 0.25, 1.0),
    hold_s=60,
    check_s=10,
    check_timeout_s=30,
    min_requests=20,
    max_error_rate_delta=0.02,
    max_latency_ratio=1.5,
    max_ttft_ratio=1.5,
)
BASE = Arm(requests=200, errors=2, p99_ms=1000, ttft_ms=100, workers=2)
GOOD = Arm(requests=50, errors=0, p99_ms=1100, ttft_ms=110, workers=1)


def judge(config: CanaryConfig = CFG) -> CanaryJudge:
    return CanaryJudge("pool:main", config, window_s=60)


def ramping(step: int = 0, since: float = 0.0) -> CanaryStatus:
    return CanaryStatus("ramping", step, since, BASE)


def test_the_check_waits_for_workers_then_passes_after_check_s() -> None:
    j, s = judge(), started(0.0)
    assert j.evaluate(s, BASE, Arm(), 5)[1] is None  # no worker yet, within the timeout
    assert j.evaluate(s, BASE, GOOD, 5)[1] is None  # a worker, but check_s not over
    _, d = j.evaluate(s, BASE, GOOD, 10)
    assert d is not None
    assert d.kind is DecisionKind.CANARY
    assert (d.new_state.phase, d.new_state.step, d.new_state.since) == ("ramping", 0, 10)
    assert d.new_state.share(CFG) == 0.05
    assert "check passed" in d.evidence.reason


def test_the_check_rolls_back_when_no_worker_comes() -> None:
    _, d = judge().evaluate(started(0.0), BASE, Arm(), 30)
    assert d is not None
    assert d.new_state.phase == "rolled_back"
    assert d.evidence.thresholds["waited_s"] == 30
    assert d.new_state.share(CFG) == 0.0


def test_the_check_rolls_back_when_the_canarys_breaker_opens() -> None:
    _, d = judge().evaluate(started(0.0), BASE, replace(GOOD, breaker_open=True), 1)
    assert d is not None
    assert d.new_state.phase == "rolled_back"


def test_a_step_advances_after_its_hold_with_a_full_window() -> None:
    j = judge()
    assert j.evaluate(ramping(0, 0), BASE, GOOD, 59)[1] is None  # hold not over
    assert j.evaluate(ramping(0, 0), BASE, replace(GOOD, requests=19), 61)[1] is None
    _, d = j.evaluate(ramping(0, 0), BASE, GOOD, 61)
    assert d is not None
    assert (d.new_state.phase, d.new_state.step) == ("ramping", 1)
    assert d.new_state.share(CFG) == 0.25
    assert d.evidence.metrics["canary_requests"] == 50
    assert d.evidence.metrics["baseline_p99_ms"] == 1000


def test_the_last_step_promotes() -> None:
    _, d = judge().evaluate(ramping(2, 0), BASE, GOOD, 61)
    assert d is not None
    assert d.new_state.phase == "promoted"
    assert d.new_state.share(CFG) == 1.0


@pytest.mark.parametrize(
    ("canary", "words"),
    [
        (replace(GOOD, errors=3), "error rate"),  # 6 % vs 1 % + 2 %
        (replace(GOOD, p99_ms=1600), "latency P99"),
        (replace(GOOD, ttft_ms=160), "mean TTFT"),
        (replace(GOOD, breaker_open=True), "breaker"),
        (replace(GOOD, workers=0), "gone"),
        (replace(GOOD, consistency_checks=20, consistency_mismatches=2), "output mismatch"),
    ],
)
def test_a_breach_rolls_back_with_the_numbers(canary: Arm, words: str) -> None:
    _, d = judge().evaluate(ramping(1, 0), BASE, canary, 5)
    assert d is not None
    assert d.new_state.phase == "rolled_back"
    assert words in d.evidence.reason
    assert "step 2/3 at 25%" in d.evidence.reason
    assert d.evidence.metrics["canary_requests"] == canary.requests


def test_the_canarys_mismatches_are_held_to_the_baselines_own() -> None:
    # 10 % of the canary's shadows disagree: past 0 + 5 % when the baseline has no
    # comparisons, within 8 % + 5 % when it shows 8 % itself (greedy noise).
    canary = replace(GOOD, consistency_checks=50, consistency_mismatches=5)
    _, d = judge().evaluate(ramping(0, 0), BASE, canary, 5)
    assert d is not None
    assert d.evidence.metrics["canary_mismatch_rate"] == pytest.approx(0.1)
    assert d.evidence.thresholds["canary_mismatch_rate"] == pytest.approx(0.05)
    noisy = replace(BASE, consistency_checks=100, consistency_mismatches=8)
    assert judge().evaluate(ramping(0, 0), noisy, canary, 5)[1] is None
    few = replace(GOOD, consistency_checks=9, consistency_mismatches=9)  # too few to judge
    assert judge().evaluate(ramping(0, 0), BASE, few, 5)[1] is None


def test_too_few_canary_requests_are_not_judged() -> None:
    bad = Arm(requests=19, errors=19, p99_ms=99_999, ttft_ms=9_999, workers=1)
    assert judge().evaluate(ramping(0, 0), BASE, bad, 5)[1] is None


def test_at_full_share_the_canary_is_held_to_the_baselines_last_full_window() -> None:
    j = judge()
    status = ramping(2, 0)
    idle = Arm(requests=3, errors=0, p99_ms=5000, ttft_ms=500, workers=2)  # too few
    status, d = j.evaluate(status, idle, GOOD, 5)
    assert d is None
    assert status.reference == BASE
    _, d = j.evaluate(status, idle, replace(GOOD, p99_ms=1600), 6)
    assert d is not None
    assert d.new_state.phase == "rolled_back"


def test_operator_commands_end_any_phase_that_is_not_final() -> None:
    j = judge()
    for status in (started(0), ramping(0), ramping(2)):
        promoted = j.command(status, "promote", 5)
        aborted = j.command(status, "abort", 5)
        assert promoted is not None
        assert promoted.new_state.phase == "promoted"
        assert aborted is not None
        assert aborted.new_state.phase == "aborted"
        assert "operator" in aborted.evidence.reason
    for phase in ("promoted", "aborted"):
        assert j.command(replace(ramping(), phase=phase), "abort", 5) is None
    for phase in FINAL:
        assert j.command(replace(ramping(), phase=phase), "promote", 5) is None
    acknowledged = j.command(replace(ramping(), phase="rolled_back"), "abort", 5)
    assert acknowledged is not None
    assert acknowledged.new_state.phase == "aborted"


def test_bad_terms_are_refused() -> None:
    for steps in [(), (0.5, 0.25, 1.0), (0.0, 1.0), (0.5, 0.9)]:
        with pytest.raises(ValueError, match=r"steps|last step"):
            CanaryConfig(steps=steps)
    with pytest.raises(ValueError, match="check_s"):
        CanaryConfig(check_s=60, check_timeout_s=30)
    with pytest.raises(ValueError, match="mismatch"):
        CanaryConfig(max_mismatch_rate_delta=-0.1)


arms = st.builds(
    Arm,
    requests=st.integers(0, 500),
    errors=st.integers(0, 50),
    p99_ms=st.none() | st.floats(1, 10_000),
    ttft_ms=st.none() | st.floats(1, 1_000),
    workers=st.integers(0, 3),
    breaker_open=st.booleans(),
    consistency_checks=st.integers(0, 50),
    consistency_mismatches=st.integers(0, 10),
).filter(lambda a: a.errors <= a.requests and a.consistency_mismatches <= a.consistency_checks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 120), arms, arms), max_size=40))
def test_any_run_moves_forward_only_and_its_share_follows_the_steps(
    ticks: list[tuple[float, Arm, Arm]],
) -> None:
    """Whatever the arms show: time only moves the release forward (step up, or to a
    final phase, never back), a final phase never changes, every change carries
    evidence, and a step is only left upward after its hold with enough requests."""
    j, status, now = judge(), started(0.0), 0.0
    order = {"checking": 0, "ramping": 1, "promoted": 2, "rolled_back": 2, "aborted": 2}
    for dt, base, canary in ticks:
        now += dt
        new, d = j.evaluate(status, base, canary, now)
        if d is None:
            assert (new.phase, new.step, new.since) == (status.phase, status.step, status.since)
        else:
            assert status.phase not in FINAL
            assert d.evidence.reason
            assert d.new_state.since == now
            assert order[d.new_state.phase] >= order[status.phase]
            if d.new_state.phase == "ramping" and status.phase == "ramping":
                assert d.new_state.step == status.step + 1
                assert now - status.since >= CFG.hold_s
                assert canary.requests >= CFG.min_requests
            if d.new_state.phase == "promoted":
                assert status.step == len(CFG.steps) - 1
                assert canary.requests >= CFG.min_requests
                assert not canary.breaker_open
            new = d.new_state
        assert 0.0 <= new.share(CFG) <= 1.0
        status = new
