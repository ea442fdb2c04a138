"""Controller settings from the environment, scaled into the policies."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.controller.settings import ControllerSettings

pytestmark = pytest.mark.unit


def test_environment_scales_the_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_TOPIC_PREFIX", "t1.")
    monkeypatch.setenv("SEAWALL_CONTROLLER_TIME_SCALE", "0.1")
    monkeypatch.setenv("SEAWALL_CONTROLLER_BATCH_SLA_MS", "250")
    monkeypatch.setenv("SEAWALL_CONTROLLER_SMALL_POOL", "tiny")
    settings = ControllerSettings()
    config = settings.decider_config()
    assert settings.app_id == "t1.seawall-controller"  # stacks sharing a broker never meet
    assert config.breaker.latency_p99_ms.recover_hold_s == pytest.approx(30.0)
    assert config.batch.sla_ms == 250.0
    assert config.small_pool == "tiny"


def test_decisions_must_not_expire_between_republications() -> None:
    with pytest.raises(ValidationError, match="re-publications"):
        ControllerSettings(controller_republish_s=60.0, controller_valid_for_s=30.0)


def test_the_latency_rows_thresholds_are_the_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = ControllerSettings().decider_config().breaker.latency_p99_ms
    assert (defaults.trip_above, defaults.recover_below) == (2000.0, 800.0)  # DESIGN's
    monkeypatch.setenv("SEAWALL_CONTROLLER_LATENCY_TRIP_MS", "3000")
    monkeypatch.setenv("SEAWALL_CONTROLLER_LATENCY_RECOVER_MS", "1500")
    monkeypatch.setenv("SEAWALL_CONTROLLER_TIME_SCALE", "0.5")
    row = ControllerSettings().decider_config().breaker.latency_p99_ms
    assert (row.trip_above, row.recover_below) == (3000.0, 1500.0)
    assert row.recover_hold_s == pytest.approx(defaults.recover_hold_s * 0.5)
    assert row.min_samples == defaults.min_samples
    with pytest.raises(ValidationError, match="hysteresis"):
        ControllerSettings(controller_latency_trip_ms=500, controller_latency_recover_ms=800)


def test_the_error_rate_rows_thresholds_are_the_operators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = ControllerSettings().decider_config().breaker.error_rate
    assert (defaults.trip_above, defaults.recover_below) == (0.30, 0.05)  # DESIGN's
    monkeypatch.setenv("SEAWALL_CONTROLLER_ERROR_RATE_TRIP", "0.5")
    monkeypatch.setenv("SEAWALL_CONTROLLER_ERROR_RATE_RECOVER", "0.1")
    monkeypatch.setenv("SEAWALL_CONTROLLER_TIME_SCALE", "0.5")
    row = ControllerSettings().decider_config().breaker.error_rate
    assert (row.trip_above, row.recover_below) == (0.5, 0.1)
    assert row.window_s == pytest.approx(defaults.window_s * 0.5)
    assert row.min_samples == defaults.min_samples
    # The ladder's error rung is its own (DESIGN: 15 %), whatever the breaker's row.
    assert ControllerSettings().decider_config().degradation.error_rate.trip_above == 0.15
    with pytest.raises(ValidationError, match="hysteresis"):
        ControllerSettings(controller_error_rate_trip=0.1, controller_error_rate_recover=0.2)
