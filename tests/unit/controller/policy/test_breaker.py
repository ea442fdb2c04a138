"""The breaker matrix, row by row, and the circuit's half-open probe."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.control import BreakerLevel
from services.controller.policy.breaker import (
    PROBE,
    Breaker,
    BreakerConfig,
    BreakerStatus,
    Circuit,
    Signal,
    breaker_readings,
)
from services.controller.policy.decision import DecisionKind, Reading
from services.controller.policy.windows import GaugeWindow, RequestWindow, wilson_lower

pytestmark = pytest.mark.unit

SAMPLES = 100  # enough for every row's min_samples


@dataclass(frozen=True)
class Row:
    signal: Signal
    trip_above: float
    recover_below: float
    window_s: float
    hold_s: float
    level: BreakerLevel


MATRIX = [
    Row(Signal.ERROR_RATE, 0.30, 0.05, 300.0, 120.0, BreakerLevel.LOG),
    Row(Signal.LATENCY_P99, 2000.0, 800.0, 60.0, 300.0, BreakerLevel.RATE_LIMIT),
    Row(Signal.CPU, 90.0, 70.0, 30.0, 600.0, BreakerLevel.REJECT_NEW),
    Row(Signal.GPU_MEMORY, 85.0, 60.0, 30.0, 180.0, BreakerLevel.EMERGENCY),
    Row(Signal.STALLED, 10.0, 1.0, 30.0, 10.0, BreakerLevel.REJECT_NEW),  # seawall's own
]
ids = [row.signal.value for row in MATRIX]


def reading(value: float) -> Reading:
    return Reading(value, SAMPLES)


def tripped_breaker(row: Row, config: BreakerConfig | None = None) -> Breaker:
    breaker = Breaker("worker:w1", config)
    assert breaker.evaluate(0.0, {row.signal: reading(row.trip_above * 2)}) is not None
    return breaker


def recover(breaker: Breaker, row: Row, start: float) -> None:
    """Hold the recovery condition from ``start`` until the breaker goes half-open."""
    breaker.evaluate(start, {row.signal: reading(0.0)})
    decision = breaker.evaluate(start + row.hold_s, {row.signal: reading(0.0)})
    assert decision is not None
    assert decision.new_state.circuit is Circuit.HALF_OPEN


@pytest.mark.parametrize("row", MATRIX, ids=ids)
def test_defaults_are_the_design_matrix(row: Row) -> None:
    threshold = BreakerConfig().rows()[row.signal]
    assert (threshold.trip_above, threshold.recover_below) == (row.trip_above, row.recover_below)
    assert (threshold.window_s, threshold.recover_hold_s) == (row.window_s, row.hold_s)


@pytest.mark.parametrize("row", MATRIX, ids=ids)
def test_row_trips_just_past_its_threshold_not_at_it(row: Row) -> None:
    breaker = Breaker("worker:w1")
    assert breaker.evaluate(0.0, {row.signal: reading(row.trip_above)}) is None
    assert breaker.status == BreakerStatus()
    past = math.nextafter(row.trip_above, math.inf)
    decision = breaker.evaluate(1.0, {row.signal: reading(past)})
    assert decision is not None
    assert decision.kind is DecisionKind.BREAKER
    assert decision.scope == "worker:w1"
    assert decision.at == 1.0
    assert decision.previous_state == BreakerStatus()
    assert decision.new_state == BreakerStatus(Circuit.OPEN, row.level, (row.signal,))
    evidence = decision.evidence
    assert evidence.window_s == row.window_s
    assert evidence.metrics[row.signal] == past
    assert evidence.thresholds[row.signal] == row.trip_above


@pytest.mark.parametrize("row", MATRIX, ids=ids)
def test_row_recovers_after_its_full_hold_not_one_tick_earlier(row: Row) -> None:
    breaker = tripped_breaker(row)
    assert breaker.evaluate(1.0, {row.signal: reading(row.recover_below)}) is None  # not below
    below = math.nextafter(row.recover_below, -math.inf)
    hold_start = 2.0
    for tick in range(int(row.hold_s)):
        assert breaker.evaluate(hold_start + tick, {row.signal: reading(below)}) is None
        assert breaker.status.circuit is Circuit.OPEN
    decision = breaker.evaluate(hold_start + row.hold_s, {row.signal: reading(below)})
    assert decision is not None
    assert decision.previous_state.circuit is Circuit.OPEN
    assert decision.new_state == BreakerStatus(Circuit.HALF_OPEN, row.level, (), 3)
    assert decision.evidence.hold_s == row.hold_s
    assert decision.evidence.thresholds[row.signal] == row.recover_below
    assert decision.evidence.thresholds[f"{row.signal}.hold_s"] == row.hold_s


@pytest.mark.parametrize("row", MATRIX, ids=ids)
def test_a_reading_in_the_band_restarts_the_recovery_hold(row: Row) -> None:
    breaker = tripped_breaker(row)
    middle = (row.trip_above + row.recover_below) / 2
    breaker.evaluate(1.0, {row.signal: reading(0.0)})
    breaker.evaluate(row.hold_s, {row.signal: reading(middle)})
    assert breaker.evaluate(row.hold_s + 1, {row.signal: reading(0.0)}) is None
    assert breaker.evaluate(2 * row.hold_s, {row.signal: reading(0.0)}) is None
    assert breaker.status.circuit is Circuit.OPEN
    assert breaker.evaluate(2 * row.hold_s + 1, {row.signal: reading(0.0)}) is not None


@pytest.mark.parametrize("signal", [Signal.ERROR_RATE, Signal.LATENCY_P99])
def test_request_rows_need_min_samples_to_trip(signal: Signal) -> None:
    breaker = Breaker("pool:main")
    assert (
        breaker.evaluate(0.0, {signal: Reading(1e9 if signal is Signal.LATENCY_P99 else 1.0, 19)})
        is None
    )
    decision = breaker.evaluate(
        1.0, {signal: Reading(1e9 if signal is Signal.LATENCY_P99 else 1.0, 20)}
    )
    assert decision is not None
    assert decision.evidence.thresholds[f"{signal}.min_samples"] == 20


def test_level_is_the_highest_tripped_row_and_follows_recoveries() -> None:
    breaker = Breaker("pool:main")
    first = breaker.evaluate(0.0, {Signal.ERROR_RATE: reading(0.5)})
    assert first is not None
    assert first.new_state.level is BreakerLevel.LOG
    second = breaker.evaluate(1.0, {Signal.ERROR_RATE: reading(0.5), Signal.CPU: reading(95.0)})
    assert second is not None
    assert second.new_state == BreakerStatus(
        Circuit.OPEN, BreakerLevel.REJECT_NEW, (Signal.ERROR_RATE, Signal.CPU)
    )
    assert second.previous_state == first.new_state
    breaker.evaluate(2.0, {Signal.ERROR_RATE: reading(0.5), Signal.CPU: reading(10.0)})
    third = breaker.evaluate(602.0, {Signal.ERROR_RATE: reading(0.5), Signal.CPU: reading(10.0)})
    assert third is not None
    assert third.new_state == BreakerStatus(Circuit.OPEN, BreakerLevel.LOG, (Signal.ERROR_RATE,))
    assert third.evidence.metrics[Signal.CPU] == 10.0


def test_rows_tripping_together_combine_their_evidence() -> None:
    breaker = Breaker("pool:main")
    decision = breaker.evaluate(
        0.0, {Signal.ERROR_RATE: reading(0.5), Signal.GPU_MEMORY: reading(99.0)}
    )
    assert decision is not None
    assert decision.new_state.level is BreakerLevel.EMERGENCY
    assert decision.evidence.metrics[Signal.ERROR_RATE] == 0.5
    assert decision.evidence.metrics[Signal.GPU_MEMORY] == 99.0
    assert decision.evidence.window_s == 300.0
    assert "error_rate" in decision.evidence.reason
    assert "gpu_memory_percent" in decision.evidence.reason


def test_no_decision_without_a_change() -> None:
    breaker = Breaker("pool:main")
    for now in range(100):
        assert breaker.evaluate(float(now), {Signal.CPU: reading(50.0)}) is None
    tripped_at = breaker.evaluate(100.0, {Signal.CPU: reading(95.0)})
    assert tripped_at is not None
    for now in range(101, 200):
        assert breaker.evaluate(float(now), {Signal.CPU: reading(95.0)}) is None


def test_half_open_probes_all_succeed_then_closed() -> None:
    row = MATRIX[0]
    breaker = tripped_breaker(row)
    recover(breaker, row, 1.0)
    assert breaker.record_probe(200.0, ok=True) is None
    assert breaker.record_probe(201.0, ok=True) is None
    decision = breaker.record_probe(202.0, ok=True)
    assert decision is not None
    assert decision.previous_state == BreakerStatus(Circuit.HALF_OPEN, BreakerLevel.LOG, (), 3)
    assert decision.new_state == BreakerStatus()
    assert decision.evidence.metrics["probe_successes"] == 3
    assert decision.evidence.thresholds["probe_requests"] == 3


@pytest.mark.parametrize(
    ("batches", "closes_at"),
    [([3], 0), ([1, 1, 1], 2), ([2, 5], 1), ([1, 0, 1, 1], 3)],
)
def test_probes_reported_together_count_as_many(batches: list[int], closes_at: int) -> None:
    """Passed probes reported in batches (a report interval's): the circuit closes with
    the batch that brings the count to ``half_open_probes``, the evidence counting them."""
    row = MATRIX[0]
    breaker = tripped_breaker(row)
    recover(breaker, row, 1.0)
    decisions = [breaker.record_probes(200.0 + i, n, 0) for i, n in enumerate(batches)]
    assert [i for i, d in enumerate(decisions) if d is not None] == [closes_at]
    closed = decisions[closes_at]
    assert closed is not None
    assert closed.new_state == BreakerStatus()
    assert closed.evidence.metrics["probe_successes"] == 3


def test_a_failure_in_a_batch_of_probes_fails_the_probe() -> None:
    row = MATRIX[0]
    breaker = tripped_breaker(row)
    recover(breaker, row, 1.0)
    failed = breaker.record_probes(200.0, 10, 1)
    assert failed is not None
    assert failed.new_state.circuit is Circuit.OPEN
    assert breaker.record_probes(201.0, 5, 0) is None  # open: probes are not counted


def test_a_failed_probe_opens_again_and_waits_before_probing_again() -> None:
    row = MATRIX[2]
    breaker = tripped_breaker(row)
    recover(breaker, row, 1.0)
    breaker.record_probe(700.0, ok=True)
    failed = breaker.record_probe(701.0, ok=False)
    assert failed is not None
    assert failed.new_state == BreakerStatus(Circuit.OPEN, BreakerLevel.REJECT_NEW, (PROBE,))
    assert failed.evidence.metrics["probe_successes"] == 1
    assert breaker.evaluate(760.0, {}) is None  # 59 s after the failure
    again = breaker.evaluate(761.0, {})
    assert again is not None
    assert again.new_state == BreakerStatus(Circuit.HALF_OPEN, BreakerLevel.REJECT_NEW, (), 3)
    assert again.evidence.thresholds["probe_retry_s"] == 60.0
    # the count starts over: three fresh successes are needed
    assert breaker.record_probe(762.0, ok=True) is None
    assert breaker.record_probe(763.0, ok=True) is None
    closed = breaker.record_probe(764.0, ok=True)
    assert closed is not None
    assert closed.new_state == BreakerStatus()


def test_a_row_tripping_while_half_open_opens_the_circuit() -> None:
    row = MATRIX[1]
    breaker = tripped_breaker(row)
    recover(breaker, row, 1.0)
    decision = breaker.evaluate(400.0, {Signal.GPU_MEMORY: reading(90.0)})
    assert decision is not None
    assert decision.previous_state.circuit is Circuit.HALF_OPEN
    assert decision.new_state == BreakerStatus(
        Circuit.OPEN, BreakerLevel.EMERGENCY, (Signal.GPU_MEMORY,)
    )


def test_probes_are_ignored_unless_half_open() -> None:
    breaker = Breaker("worker:w1")
    assert breaker.record_probe(0.0, ok=False) is None
    assert breaker.status == BreakerStatus()
    tripped = tripped_breaker(MATRIX[0])
    assert tripped.record_probe(1.0, ok=True) is None
    assert tripped.status.circuit is Circuit.OPEN


def test_configurable_probe_count_and_holds_in_seconds() -> None:
    config = BreakerConfig(half_open_probes=1, probe_retry_s=0.0)
    breaker = Breaker("worker:w1", config)
    breaker.evaluate(0.0, {Signal.CPU: reading(95.0)})
    recover(breaker, MATRIX[2], 1.0)
    assert breaker.status.probe_requests == 1
    closed = breaker.record_probe(700.0, ok=True)
    assert closed is not None
    assert closed.new_state == BreakerStatus()


@pytest.mark.parametrize("bad", [{"half_open_probes": 0}, {"probe_retry_s": -1.0}])
def test_invalid_config_is_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        BreakerConfig(**bad)  # type: ignore[arg-type]


def test_readings_from_windows_drive_the_matrix() -> None:
    config = BreakerConfig()
    requests, cpu, memory = RequestWindow(), GaugeWindow(), GaugeWindow()
    for i in range(40):
        requests.record(float(i), 100.0, ok=i % 3 == 0)  # 26 of 40 fail: 65%
        cpu.record(float(i), 50.0)
    memory.record(39.0, 40.0)
    readings = breaker_readings(config, 39.0, requests, cpu, memory)
    # The rate, and the lower bound of what it may truly be (what must pass 30%).
    low = wilson_lower(26, 40, config.error_rate_z)
    assert 0.3 < low < 26 / 40
    assert readings[Signal.ERROR_RATE] == Reading(26 / 40, 40, low)
    assert readings[Signal.CPU] == Reading(50.0, 40)
    assert readings[Signal.GPU_MEMORY] == Reading(40.0, 1)
    latency = readings[Signal.LATENCY_P99]
    assert latency is not None
    assert latency.value == pytest.approx(100.0, rel=0.01)
    decision = Breaker("worker:w1", config).evaluate(39.0, readings)
    assert decision is not None
    assert decision.new_state.tripped == (Signal.ERROR_RATE,)


def test_readings_of_an_idle_scope_are_quiet() -> None:
    readings = breaker_readings(BreakerConfig(), 0.0, RequestWindow(), GaugeWindow(), GaugeWindow())
    assert set(readings.values()) == {None}


@settings(max_examples=40, deadline=None)
@given(
    row=st.sampled_from(MATRIX),
    start_open=st.booleans(),
    steps=st.lists(st.tuples(st.floats(0.5, 120.0), st.floats(0.0, 1.0)), max_size=100),
)
def test_noise_between_recovery_and_trip_thresholds_never_changes_state(
    row: Row, start_open: bool, steps: list[tuple[float, float]]
) -> None:
    breaker = tripped_breaker(row) if start_open else Breaker("worker:w1")
    before = breaker.status
    now = 1.0
    for gap, position in steps:
        now += gap
        value = row.recover_below + position * (row.trip_above - row.recover_below)
        assert breaker.evaluate(now, {row.signal: reading(value)}) is None
    assert breaker.status == before


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.5, 200.0), st.sampled_from(MATRIX), st.floats(0.0, 2.0)),
        max_size=150,
    )
)
def test_circuit_changes_are_bounded_under_any_noise(
    steps: list[tuple[float, Row, float]],
) -> None:
    """Reopening needs a trip, and leaving open needs a full recovery hold after it, so
    the circuit cannot change state more often than once per shortest hold (each way)."""
    breaker = Breaker("pool:main")
    shortest_hold = min(row.hold_s for row in MATRIX)
    now, changes = 0.0, 0
    for gap, row, scale in steps:
        now += gap
        before = breaker.status.circuit
        breaker.evaluate(now, {row.signal: reading(scale * row.trip_above)})
        changes += breaker.status.circuit is not before
    assert changes <= 2 * (now // shortest_hold + 1)


def test_the_failed_probe_keeps_the_level_it_was_guarding() -> None:
    row = MATRIX[0]
    breaker = tripped_breaker(row, BreakerConfig(probe_retry_s=1000.0))
    recover(breaker, row, 1.0)
    breaker.record_probe(200.0, ok=False)
    hot = breaker.evaluate(201.0, {Signal.GPU_MEMORY: reading(90.0)})
    assert hot is not None
    assert hot.new_state == BreakerStatus(
        Circuit.OPEN, BreakerLevel.EMERGENCY, (Signal.GPU_MEMORY, PROBE)
    )
    breaker.evaluate(202.0, {Signal.GPU_MEMORY: reading(10.0)})
    cooled = breaker.evaluate(382.0, {Signal.GPU_MEMORY: reading(10.0)})
    assert cooled is not None
    assert cooled.new_state == BreakerStatus(Circuit.OPEN, BreakerLevel.LOG, (PROBE,))
    again = breaker.evaluate(1200.0, {})
    assert again is not None
    assert again.new_state == BreakerStatus(Circuit.HALF_OPEN, BreakerLevel.LOG, (), 3)
