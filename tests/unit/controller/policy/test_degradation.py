"""The degradation ladder, rung by rung: triggers, exits, and the highest rung wins."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.policy.decision import DecisionKind, Reading
from services.controller.policy.degradation import (
    DegradationConfig,
    DegradationLadder,
    DegradationStatus,
    Trigger,
    degradation_readings,
)
from services.controller.policy.windows import GaugeWindow, RequestWindow

pytestmark = pytest.mark.unit

SAMPLES = 100


@dataclass(frozen=True)
class Rung:
    trigger: Trigger
    level: int
    trip_above: float
    trip_hold_s: float
    recover_below: float
    recover_hold_s: float


LADDER = [
    Rung(Trigger.LATENCY_P99, 1, 2000.0, 300.0, 1500.0, 300.0),
    Rung(Trigger.PREEMPTIONS, 1, 1.0, 60.0, 0.1, 120.0),
    Rung(Trigger.ERROR_RATE, 2, 0.15, 0.0, 0.05, 120.0),
    Rung(Trigger.GPU_TEMPERATURE, 3, 85.0, 0.0, 75.0, 180.0),
]
ids = [rung.trigger.value for rung in LADDER]


def reading(value: float) -> Reading:
    return Reading(value, SAMPLES)


def triggered(rung: Rung) -> DegradationLadder:
    ladder = DegradationLadder("pool:main")
    ladder.evaluate(0.0, {rung.trigger: reading(rung.trip_above * 2)})
    decision = ladder.evaluate(rung.trip_hold_s, {rung.trigger: reading(rung.trip_above * 2)})
    assert ladder.status.level == rung.level, decision
    return ladder


@pytest.mark.parametrize("rung", LADDER, ids=ids)
def test_rung_triggers_just_past_its_threshold_for_its_duration(rung: Rung) -> None:
    ladder = DegradationLadder("pool:main")
    for tick in range(int(rung.trip_hold_s) + 10):
        assert ladder.evaluate(float(tick), {rung.trigger: reading(rung.trip_above)}) is None
    past = math.nextafter(rung.trip_above, math.inf)
    start = 1000.0
    for tick in range(int(rung.trip_hold_s)):
        assert ladder.evaluate(start + tick, {rung.trigger: reading(past)}) is None
    decision = ladder.evaluate(start + rung.trip_hold_s, {rung.trigger: reading(past)})
    assert decision is not None
    assert decision.kind is DecisionKind.DEGRADATION
    assert decision.previous_state == DegradationStatus()
    assert decision.new_state == DegradationStatus(rung.level, (rung.trigger,))
    assert decision.evidence.metrics[rung.trigger] == past
    assert decision.evidence.thresholds[rung.trigger] == rung.trip_above
    assert decision.evidence.hold_s == rung.trip_hold_s


def test_level_one_needs_slowness_for_five_minutes_without_a_break() -> None:
    ladder = DegradationLadder("pool:main")
    for tick in range(299):
        ladder.evaluate(float(tick), {Trigger.LATENCY_P99: reading(2500.0)})
    ladder.evaluate(299.0, {Trigger.LATENCY_P99: reading(1900.0)})
    for tick in range(300, 599):
        assert ladder.evaluate(float(tick), {Trigger.LATENCY_P99: reading(2500.0)}) is None
    assert ladder.evaluate(600.0, {Trigger.LATENCY_P99: reading(2500.0)}) is not None


@pytest.mark.parametrize("rung", LADDER, ids=ids)
def test_rung_exits_after_its_full_hold_not_one_tick_earlier(rung: Rung) -> None:
    ladder = triggered(rung)
    start = rung.trip_hold_s + 1
    assert ladder.evaluate(start, {rung.trigger: reading(rung.recover_below)}) is None
    below = math.nextafter(rung.recover_below, -math.inf)
    for tick in range(int(rung.recover_hold_s)):
        assert ladder.evaluate(start + 1 + tick, {rung.trigger: reading(below)}) is None
    decision = ladder.evaluate(start + 1 + rung.recover_hold_s, {rung.trigger: reading(below)})
    assert decision is not None
    assert decision.new_state == DegradationStatus()
    assert decision.evidence.thresholds[rung.trigger] == rung.recover_below
    assert decision.evidence.hold_s == rung.recover_hold_s


def test_the_highest_triggered_rung_is_the_level() -> None:
    ladder = DegradationLadder("pool:main")
    hot = ladder.evaluate(0.0, {Trigger.GPU_TEMPERATURE: reading(90.0)})
    assert hot is not None
    assert hot.new_state.level == 3
    errors = ladder.evaluate(
        1.0, {Trigger.GPU_TEMPERATURE: reading(90.0), Trigger.ERROR_RATE: reading(0.5)}
    )
    assert errors is not None
    assert errors.new_state == DegradationStatus(3, (Trigger.ERROR_RATE, Trigger.GPU_TEMPERATURE))
    cool = {Trigger.GPU_TEMPERATURE: reading(60.0), Trigger.ERROR_RATE: reading(0.5)}
    ladder.evaluate(2.0, cool)
    cooled = ladder.evaluate(182.0, cool)
    assert cooled is not None
    assert cooled.previous_state.level == 3
    assert cooled.new_state == DegradationStatus(2, (Trigger.ERROR_RATE,))


def test_configurable_exits_in_seconds() -> None:
    config = DegradationConfig()
    assert config.gpu_temperature_c.recover_below == 75.0
    ladder = DegradationLadder("pool:main", config)
    assert ladder.evaluate(0.0, {Trigger.ERROR_RATE: Reading(1.0, 19)}) is None  # min samples


def test_readings_from_windows() -> None:
    requests, temperature, preemptions = RequestWindow(), GaugeWindow(), GaugeWindow()
    for i in range(60):
        requests.record(float(i), 3000.0, ok=i % 4 != 0)
        temperature.record(float(i), 70.0 + (20.0 if i == 50 else 0.0))
        preemptions.record(float(i), 3 if i % 2 else 0)  # 90 preemptions in 60 reports
    readings = degradation_readings(DegradationConfig(), 59.0, requests, temperature, preemptions)
    assert readings[Trigger.ERROR_RATE] == Reading(0.25, 60)
    assert readings[Trigger.PREEMPTIONS] == Reading(90 / 60.0, 60)  # a rate per second
    # the max, not the mean, over the buckets from t=20 (holding now - 30 s) on
    assert readings[Trigger.GPU_TEMPERATURE] == Reading(90.0, 40)
    latency = readings[Trigger.LATENCY_P99]
    assert latency is not None
    assert latency.value == pytest.approx(3000.0, rel=0.01)
    decision = DegradationLadder("pool:main").evaluate(59.0, readings)
    assert decision is not None
    assert decision.new_state == DegradationStatus(3, (Trigger.ERROR_RATE, Trigger.GPU_TEMPERATURE))


@settings(max_examples=40, deadline=None)
@given(
    rung=st.sampled_from(LADDER),
    start_on=st.booleans(),
    steps=st.lists(st.tuples(st.floats(0.5, 120.0), st.floats(0.0, 1.0)), max_size=100),
)
def test_noise_between_exit_and_trigger_never_changes_the_level(
    rung: Rung, start_on: bool, steps: list[tuple[float, float]]
) -> None:
    ladder = triggered(rung) if start_on else DegradationLadder("pool:main")
    before = ladder.status
    now = 1000.0
    for gap, position in steps:
        now += gap
        value = rung.recover_below + position * (rung.trip_above - rung.recover_below)
        assert ladder.evaluate(now, {rung.trigger: reading(value)}) is None
    assert ladder.status == before
