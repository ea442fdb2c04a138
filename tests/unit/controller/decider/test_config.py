"""The decider's configuration: scaled to another time scale, and its bounds."""

from __future__ import annotations

import pytest

from services.controller.decider.config import DeciderConfig, scaled_config

pytestmark = pytest.mark.unit


def test_time_scale_multiplies_every_window_and_hold_but_no_threshold() -> None:
    config = scaled_config(
        0.01,
        batch_sla_ms=300.0,
        heartbeat_timeout_s=2.0,
        republish_s=1.0,
        valid_for_s=10.0,
        forget_after_s=60.0,
        max_telemetry_age_s=5.0,
        small_pool="small",
        max_tokens_cap=256,
    )
    default = DeciderConfig()
    assert config.breaker.error_rate.window_s == pytest.approx(3.0)
    assert config.breaker.error_rate.recover_hold_s == pytest.approx(1.2)
    assert config.breaker.error_rate.trip_above == default.breaker.error_rate.trip_above
    assert config.degradation.latency_p99_ms.trip_hold_s == pytest.approx(3.0)
    assert config.breaker.probe_retry_s == pytest.approx(0.6)
    assert config.batch.min_interval_s == pytest.approx(0.05)
    assert config.batch.sla_ms == 300.0
    assert config.heartbeat.timeout_s == 2.0  # not a policy window
    assert config.request_window_s == pytest.approx(3.0)


def test_republishing_must_be_more_frequent_than_validity() -> None:
    with pytest.raises(ValueError, match="republish_s"):
        DeciderConfig(republish_s=60.0, valid_for_s=60.0)
