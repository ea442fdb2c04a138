"""Heartbeat loss isolates a worker; its return goes through the half-open probe."""

from __future__ import annotations

import pytest

from schemas.control import BreakerLevel
from services.controller.policy.breaker import HEARTBEAT, Breaker, BreakerStatus, Circuit, Signal
from services.controller.policy.decision import DecisionKind, Reading
from services.controller.policy.heartbeat import HeartbeatConfig, HeartbeatMonitor, Liveness

pytestmark = pytest.mark.unit


def test_first_beat_registers_silently() -> None:
    monitor = HeartbeatMonitor()
    assert monitor.liveness("worker:a") is None
    assert monitor.beat("worker:a", 0.0) is None
    assert monitor.liveness("worker:a") is Liveness.ALIVE


def test_lost_strictly_past_the_timeout_with_evidence() -> None:
    monitor = HeartbeatMonitor(HeartbeatConfig(timeout_s=10.0))
    monitor.beat("worker:a", 0.0)
    monitor.beat("worker:a", 5.0)
    assert monitor.check(15.0) == []  # exactly the timeout: not yet
    [lost] = monitor.check(15.5)
    assert lost.kind is DecisionKind.HEARTBEAT
    assert (lost.scope, lost.at) == ("worker:a", 15.5)
    assert (lost.previous_state, lost.new_state) == (Liveness.ALIVE, Liveness.LOST)
    assert lost.evidence.metrics == {"heartbeat_age_s": 10.5, "last_seen_at": 5.0}
    assert lost.evidence.thresholds == {"heartbeat_timeout_s": 10.0}
    assert lost.evidence.window_s == 10.0
    assert monitor.check(100.0) == []  # reported once


def test_only_silent_workers_are_lost() -> None:
    monitor = HeartbeatMonitor()
    monitor.beat("worker:a", 0.0)
    monitor.beat("worker:b", 0.0)
    for now in range(1, 12):
        monitor.beat("worker:b", float(now))
    assert [d.scope for d in monitor.check(11.0)] == ["worker:a"]


def test_return_after_loss() -> None:
    monitor = HeartbeatMonitor()
    monitor.beat("worker:a", 0.0)
    monitor.check(20.0)
    back = monitor.beat("worker:a", 42.0)
    assert back is not None
    assert (back.previous_state, back.new_state) == (Liveness.LOST, Liveness.ALIVE)
    assert back.evidence.metrics == {"heartbeat_gap_s": 42.0, "last_seen_at": 0.0}
    assert monitor.beat("worker:a", 43.0) is None
    assert monitor.check(50.0) == []


def test_a_late_beat_does_not_move_last_seen_backwards() -> None:
    monitor = HeartbeatMonitor()
    monitor.beat("worker:a", 10.0)
    monitor.beat("worker:a", 4.0)
    assert monitor.check(20.0) == []


def test_forgotten_workers_are_not_reported() -> None:
    monitor = HeartbeatMonitor()
    monitor.beat("worker:a", 0.0)
    monitor.forget("worker:a")
    assert monitor.check(100.0) == []
    assert monitor.liveness("worker:a") is None


def test_invalid_timeout_is_rejected() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        HeartbeatConfig(timeout_s=0.0)


def test_loss_isolates_the_worker_and_return_goes_through_half_open() -> None:
    monitor, breaker = HeartbeatMonitor(), Breaker("worker:a")
    monitor.beat("worker:a", 0.0)
    [lost] = monitor.check(11.0)
    isolated = breaker.on_liveness(lost)
    assert isolated is not None
    assert isolated.new_state == BreakerStatus(Circuit.OPEN, BreakerLevel.LOG, (HEARTBEAT,))
    assert isolated.evidence == lost.evidence
    back = monitor.beat("worker:a", 30.0)
    assert back is not None
    probing = breaker.on_liveness(back)
    assert probing is not None
    assert probing.new_state == BreakerStatus(Circuit.HALF_OPEN, BreakerLevel.LOG, (), 3)
    for now in (31.0, 32.0):
        assert breaker.record_probe(now, ok=True) is None
    closed = breaker.record_probe(33.0, ok=True)
    assert closed is not None
    assert closed.new_state == BreakerStatus()


def test_return_while_a_row_is_still_tripped_stays_open() -> None:
    monitor, breaker = HeartbeatMonitor(), Breaker("worker:a")
    breaker.evaluate(0.0, {Signal.GPU_MEMORY: Reading(95.0, 1)})
    monitor.beat("worker:a", 0.0)
    [lost] = monitor.check(11.0)
    both = breaker.on_liveness(lost)
    assert both is not None
    assert both.new_state.tripped == (Signal.GPU_MEMORY, HEARTBEAT)
    assert both.new_state.level is BreakerLevel.EMERGENCY
    back = monitor.beat("worker:a", 12.0)
    assert back is not None
    still = breaker.on_liveness(back)
    assert still is not None
    assert still.new_state == BreakerStatus(
        Circuit.OPEN, BreakerLevel.EMERGENCY, (Signal.GPU_MEMORY,)
    )


def test_liveness_of_another_scope_is_refused() -> None:
    monitor = HeartbeatMonitor()
    monitor.beat("worker:a", 0.0)
    [lost] = monitor.check(11.0)
    with pytest.raises(ValueError, match="worker:a"):
        Breaker("worker:b").on_liveness(lost)
