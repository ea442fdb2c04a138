"""The held-for-duration helper and the hysteresis latch every policy row is made of."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.policy.decision import Evidence, Reading
from services.controller.policy.hysteresis import HoldTimer, Latch, LatchSet, Threshold

pytestmark = pytest.mark.unit

ROW = Threshold(trip_above=10.0, recover_below=4.0, window_s=60.0, recover_hold_s=30.0)


def just_past(x: float) -> float:
    return math.nextafter(x, math.inf)


def just_below(x: float) -> float:
    return math.nextafter(x, -math.inf)


@pytest.mark.parametrize(
    ("duration", "observations", "expected"),
    [
        (0.0, [(0.0, True)], [True]),
        (5.0, [(0.0, True), (4.0, True), (5.0, True)], [False, False, True]),
        (5.0, [(0.0, True), (3.0, False), (5.0, True), (9.0, True), (10.0, True)],
         [False, False, False, False, True]),
        (5.0, [(0.0, False), (1.0, True), (6.0, True)], [False, False, True]),
    ],
)  # fmt: skip
def test_hold_timer(
    duration: float, observations: list[tuple[float, bool]], expected: list[bool]
) -> None:
    timer = HoldTimer(duration)
    assert [timer.observe(now, held) for now, held in observations] == expected


def test_hold_timer_reports_how_long_it_held_and_resets() -> None:
    timer = HoldTimer(5.0)
    assert timer.held_for(3.0) == 0.0
    timer.observe(1.0, True)
    assert timer.held_for(4.0) == 3.0
    timer.reset()
    assert timer.held_for(4.0) == 0.0


@pytest.mark.parametrize("trip_above", [0.0, 0.3, 85.0, 2000.0])
def test_trips_strictly_past_the_threshold_not_at_it(trip_above: float) -> None:
    latch = Latch("m", Threshold(trip_above=trip_above, recover_below=0.0, window_s=1.0))
    assert latch.update(0.0, Reading(trip_above, 100)) is None
    assert not latch.tripped
    assert latch.update(1.0, Reading(just_past(trip_above), 100)) is not None
    assert latch.tripped


def test_recovers_only_after_the_full_hold_not_one_tick_earlier() -> None:
    latch = Latch("m", ROW)
    latch.update(0.0, Reading(11.0, 1))
    for now in range(1, 31):  # below recover_below from t=1: held 29 s at t=30
        assert latch.update(float(now), Reading(3.0, 1)) is None
        assert latch.tripped
    evidence = latch.update(31.0, Reading(3.0, 1))
    assert evidence is not None
    assert not latch.tripped
    assert evidence.hold_s == 30.0


def test_value_at_the_recovery_threshold_does_not_recover() -> None:
    latch = Latch("m", ROW)
    latch.update(0.0, Reading(11.0, 1))
    for now in range(1, 200):
        latch.update(float(now), Reading(4.0, 1))
    assert latch.tripped


def test_one_violating_sample_restarts_the_recovery_hold() -> None:
    latch = Latch("m", ROW)
    latch.update(0.0, Reading(11.0, 1))
    latch.update(1.0, Reading(1.0, 1))
    latch.update(20.0, Reading(5.0, 1))  # in the band: not a recovery sample
    assert latch.update(31.0, Reading(1.0, 1)) is None  # hold restarted at 31
    assert latch.update(60.0, Reading(1.0, 1)) is None
    assert latch.update(61.0, Reading(1.0, 1)) is not None


def test_trip_hold_needs_the_trip_condition_continuously() -> None:
    row = Threshold(trip_above=10.0, recover_below=4.0, window_s=60.0, trip_hold_s=5.0)
    latch = Latch("m", row)
    assert latch.update(0.0, Reading(11.0, 1)) is None
    assert latch.update(4.0, Reading(11.0, 1)) is None
    assert latch.update(4.5, Reading(10.0, 1)) is None  # at the threshold: resets
    assert latch.update(9.0, Reading(11.0, 1)) is None
    evidence = latch.update(14.0, Reading(11.0, 1))
    assert evidence is not None
    assert evidence.hold_s == 5.0


def test_too_few_samples_cannot_trip_and_count_as_healthy() -> None:
    row = Threshold(trip_above=0.3, recover_below=0.05, window_s=300.0, recover_hold_s=10.0,
                    min_samples=20)  # fmt: skip
    latch = Latch("error_rate", row)
    assert latch.update(0.0, Reading(1.0, 19)) is None
    assert latch.update(1.0, None) is None
    assert latch.update(2.0, Reading(0.31, 20)) is not None
    assert latch.update(3.0, Reading(1.0, 5)) is None  # quiet: the recovery hold starts
    evidence = latch.update(13.0, None)
    assert evidence is not None
    assert "quiet" in evidence.reason
    assert not latch.tripped


def test_evidence_carries_window_values_thresholds_and_hold() -> None:
    latch = Latch("latency_p99_ms", ROW)
    trip = latch.update(0.0, Reading(12.5, 40))
    assert trip == Evidence(
        reason="latency_p99_ms 12.5 > 10 over 60s",
        window_s=60.0,
        metrics={"latency_p99_ms": 12.5, "latency_p99_ms.samples": 40.0},
        thresholds={
            "latency_p99_ms": 10.0,
            "latency_p99_ms.hold_s": 0.0,
            "latency_p99_ms.min_samples": 1.0,
        },
        hold_s=0.0,
    )
    latch.update(1.0, Reading(2.0, 40))
    recovery = latch.update(40.0, Reading(3.0, 40))
    assert recovery is not None
    assert recovery.thresholds["latency_p99_ms"] == 4.0
    assert recovery.thresholds["latency_p99_ms.hold_s"] == 30.0
    assert recovery.metrics["latency_p99_ms"] == 3.0
    assert recovery.hold_s == 39.0
    assert recovery.reason == "latency_p99_ms 3 < 4 over 60s, held 39s (>= 30s)"


def test_evidence_is_immutable() -> None:
    evidence = Evidence(reason="r", metrics={"a": 1.0})
    with pytest.raises(TypeError):
        evidence.metrics["a"] = 2.0  # type: ignore[index]


def test_threshold_without_a_hysteresis_band_is_rejected() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        Threshold(trip_above=4.0, recover_below=10.0, window_s=1.0)


def test_latch_set_reports_flips_in_row_order_and_missing_readings_are_quiet() -> None:
    rows = LatchSet({"a": ROW, "b": ROW})
    flips = rows.update(0.0, {"b": Reading(11.0, 1), "a": Reading(11.0, 1)})
    assert [e.metrics.keys() >= {"a"} for e in flips] == [True, False]
    assert rows.tripped == ("a", "b")
    assert rows.update(1.0, {}) == []
    assert len(rows.update(31.0, {})) == 2
    assert not rows.tripped


band = st.floats(min_value=ROW.recover_below, max_value=ROW.trip_above)
times = st.lists(st.floats(min_value=0.001, max_value=100.0), min_size=1, max_size=200)


@settings(max_examples=60, deadline=None)
@given(start_tripped=st.booleans(), gaps=times, data=st.data())
def test_noise_between_the_thresholds_never_changes_state(
    start_tripped: bool, gaps: list[float], data: st.DataObject
) -> None:
    latch = Latch("m", ROW)
    if start_tripped:
        latch.update(-1.0, Reading(ROW.trip_above + 1, 1))
    now = 0.0
    for gap in gaps:
        now += gap
        assert latch.update(now, Reading(data.draw(band), 1)) is None
        assert latch.tripped is start_tripped


@settings(max_examples=60, deadline=None)
@given(samples=st.lists(st.tuples(st.floats(0.001, 50.0), st.floats(0.0, 20.0)), max_size=300))
def test_state_changes_are_bounded_by_the_recovery_hold(
    samples: list[tuple[float, float]],
) -> None:
    """Whatever the noise, each trip-recover cycle takes at least the recovery hold."""
    latch = Latch("m", ROW)
    now, flips = 0.0, 0
    for gap, value in samples:
        now += gap
        flips += latch.update(now, Reading(value, 1)) is not None
    assert flips <= 2 * (now // ROW.recover_hold_s) + 1
