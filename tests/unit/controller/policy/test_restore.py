"""Seeding the policies with the state a previous controller had in force: no decision
is made by the seeding itself, and recovery must then hold in full again."""

from __future__ import annotations

import pytest

from schemas.control import BreakerLevel
from services.controller.policy import (
    Breaker,
    BreakerStatus,
    Circuit,
    DegradationLadder,
    DegradationStatus,
    HeartbeatMonitor,
    Latch,
    Liveness,
    Reading,
    Signal,
    Threshold,
    Trigger,
)
from services.controller.policy.breaker import HEARTBEAT, PROBE

pytestmark = pytest.mark.unit

LOW = Reading(0.0, 100)


def test_a_restored_latch_must_hold_its_recovery_from_the_restore() -> None:
    latch = Latch("x", Threshold(trip_above=10, recover_below=5, window_s=1, recover_hold_s=30))
    latch.restore(True)
    assert latch.tripped
    assert latch.update(100.0, Reading(1.0, 1)) is None  # the hold starts here
    assert latch.update(129.0, Reading(1.0, 1)) is None
    evidence = latch.update(130.0, Reading(1.0, 1))
    assert evidence is not None
    assert not latch.tripped


def test_a_restored_open_breaker_stays_open_until_its_rows_recover() -> None:
    breaker = Breaker("worker:w1")
    status = BreakerStatus(Circuit.OPEN, BreakerLevel.RATE_LIMIT, (Signal.LATENCY_P99,))
    breaker.restore(status, now=0.0)
    assert breaker.status == status
    hold = breaker.config.latency_p99_ms.recover_hold_s
    assert breaker.evaluate(1.0, {Signal.LATENCY_P99: Reading(100.0, 100)}) is None
    assert breaker.evaluate(hold, {Signal.LATENCY_P99: Reading(100.0, 100)}) is None
    decision = breaker.evaluate(hold + 1.0, {Signal.LATENCY_P99: Reading(100.0, 100)})
    assert decision is not None
    assert decision.new_state.circuit is Circuit.HALF_OPEN
    assert decision.new_state.level is BreakerLevel.RATE_LIMIT


def test_a_restored_heartbeat_loss_and_failed_probe_keep_their_causes() -> None:
    breaker = Breaker("worker:w1")
    status = BreakerStatus(Circuit.OPEN, BreakerLevel.REJECT_NEW, (HEARTBEAT, PROBE))
    breaker.restore(status, now=0.0)
    # the failed probe waits its retry again from the restore; heartbeat loss stays
    assert breaker.evaluate(1.0, {}) is None
    decision = breaker.evaluate(breaker.config.probe_retry_s, {})
    assert decision is not None
    assert decision.new_state == BreakerStatus(Circuit.OPEN, BreakerLevel.LOG, (HEARTBEAT,))


def test_a_restored_half_open_breaker_takes_its_probes() -> None:
    breaker = Breaker("pool:main")
    breaker.restore(BreakerStatus(Circuit.HALF_OPEN, BreakerLevel.LOG, (), 3), now=0.0)
    assert breaker.record_probe(1.0, ok=True) is None
    assert breaker.record_probe(2.0, ok=True) is None
    decision = breaker.record_probe(3.0, ok=True)
    assert decision is not None
    assert decision.new_state == BreakerStatus()


def test_a_restored_ladder_keeps_its_level_until_the_rung_recovers() -> None:
    ladder = DegradationLadder("pool:main")
    ladder.restore(DegradationStatus(3, (Trigger.GPU_TEMPERATURE,)))
    cool = {Trigger.GPU_TEMPERATURE: Reading(60.0, 5)}
    hold = ladder.config.gpu_temperature_c.recover_hold_s
    assert ladder.evaluate(0.0, cool) is None
    assert ladder.status.level == 3
    decision = ladder.evaluate(hold, cool)
    assert decision is not None
    assert decision.new_state == DegradationStatus()


def test_restored_workers_are_lost_after_the_timeout_or_report_their_return() -> None:
    monitor = HeartbeatMonitor()
    monitor.restore("worker:a", 100.0, Liveness.ALIVE)
    monitor.restore("worker:b", 100.0, Liveness.LOST)
    assert monitor.check(105.0) == []
    (lost,) = monitor.check(111.0)
    assert lost.scope == "worker:a"
    back = monitor.beat("worker:b", 112.0)
    assert back is not None
    assert back.new_state is Liveness.ALIVE
