"""Share alerts: long prompts (> 30% over 4096 tokens) and output mismatches, with hysteresis."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.controller.policy.decision import DecisionKind
from services.controller.policy.hysteresis import Threshold
from services.controller.policy.shares import LONG_PROMPTS, OUTPUT_MISMATCHES, ShareAlert

pytestmark = pytest.mark.unit


def feed(alert: ShareAlert, now: float, long: int, short: int) -> None:
    alert.record(now, long + short, long)


def test_counts_arrive_in_batches() -> None:
    alert = ShareAlert(LONG_PROMPTS)
    alert.record(0.0, 20, 0)
    assert alert.evaluate(0.0) is None
    alert.record(1.0, 20, 20)
    assert alert.evaluate(1.0) is not None
    with pytest.raises(ValueError, match="hits"):
        alert.record(2.0, 3, 4)


def test_on_strictly_past_30_percent_not_at_it() -> None:
    alert = ShareAlert(LONG_PROMPTS)
    feed(alert, 0.0, long=30, short=70)
    assert alert.evaluate(0.0) is None
    assert not alert.on
    feed(alert, 1.0, long=1, short=0)
    decision = alert.evaluate(1.0)
    assert decision is not None
    assert decision.kind is DecisionKind.LONG_PROMPT_ALERT
    assert (decision.previous_state, decision.new_state) == (False, True)
    evidence = decision.evidence
    assert evidence.metrics["long_prompt_share"] == pytest.approx(31 / 101)
    assert evidence.thresholds["long_prompt_share"] == 0.30
    assert evidence.thresholds["long_prompt_tokens"] == 4096
    assert evidence.window_s == 300.0


def test_needs_min_samples() -> None:
    alert = ShareAlert(LONG_PROMPTS)
    feed(alert, 0.0, long=19, short=0)
    assert alert.evaluate(0.0) is None
    feed(alert, 1.0, long=1, short=0)
    assert alert.evaluate(1.0) is not None


def test_turns_off_below_20_percent_held_a_minute() -> None:
    alert = ShareAlert(LONG_PROMPTS)
    feed(alert, 0.0, long=50, short=50)
    assert alert.evaluate(0.0) is not None
    feed(alert, 10.0, long=0, short=100)  # 25%: in the band, stays on
    assert alert.evaluate(10.0) is None
    feed(alert, 20.0, long=0, short=100)  # 50 / 300 < 20%: the hold starts
    assert alert.evaluate(20.0) is None
    assert alert.evaluate(79.0) is None
    assert alert.on
    off = alert.evaluate(80.0)
    assert off is not None
    assert (off.previous_state, off.new_state) == (True, False)
    assert off.evidence.hold_s == 60.0


def test_alert_clears_when_the_long_prompts_age_out() -> None:
    alert = ShareAlert(replace(LONG_PROMPTS, share=Threshold(0.3, 0.2, window_s=60.0)))
    feed(alert, 0.0, long=30, short=0)
    assert alert.evaluate(0.0) is not None
    assert alert.evaluate(70.0) is not None  # window empty: quiet counts as healthy
    assert not alert.on


def test_output_mismatches_alert_past_10_percent_of_10_comparisons() -> None:
    alert = ShareAlert(OUTPUT_MISMATCHES, "pool:main")
    alert.record(0.0, 9, 9)
    assert alert.evaluate(0.0) is None  # nine comparisons are too few to say
    alert.record(1.0, 1, 0)
    on = alert.evaluate(1.0)
    assert on is not None
    assert on.kind is DecisionKind.OUTPUT_CONSISTENCY_ALERT
    assert on.scope == "pool:main"
    assert on.evidence.metrics["output_mismatch_rate"] == pytest.approx(0.9)
    assert on.evidence.thresholds["output_mismatch_rate"] == 0.10
    assert on.evidence.thresholds["output_mismatch_rate.min_samples"] == 10


def test_a_few_mismatches_among_many_comparisons_stay_quiet() -> None:
    alert = ShareAlert(OUTPUT_MISMATCHES)
    alert.record(0.0, 100, 10)  # 10 %: at the line, not past it
    assert alert.evaluate(0.0) is None
    assert not alert.on
