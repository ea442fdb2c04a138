"""The decider's configuration: scaled to another time scale, and its bounds."""

from __future__ import annotations

import pytest

from services.controller.decider.config import DeciderConfig, scaled_config
from services.controller.decider.pool import PoolDecider
from tests.unit.controller.decider.test_pool import T0, gpu, report

pytestmark = pytest.mark.unit


def config_at(time_scale: float) -> DeciderConfig:
    return scaled_config(
        time_scale,
        batch_sla_ms=300.0,
        heartbeat_timeout_s=2.0,
        republish_s=1.0,
        valid_for_s=10.0,
        forget_after_s=60.0,
        max_telemetry_age_s=5.0,
        small_pool="small",
        max_tokens_cap=256,
    )


def test_time_scale_multiplies_every_window_and_hold_but_no_threshold() -> None:
    config = config_at(0.01)
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


@pytest.mark.parametrize("time_scale", [0.001, 0.01, 0.1, 1.0, 10.0])
def test_a_pool_decides_at_any_time_scale(time_scale: float) -> None:
    # At 0.01 the output-mismatch alert's window (3 s) was once narrower than its fixed
    # 10 s buckets, and every telemetry record of the pool failed (bench/reaction.py).
    config = config_at(time_scale)
    decider = PoolDecider("main", config, T0, None, {})
    decider.observe(gpu("w1", T0), T0)
    decider.observe(report("w1", T0), T0)
    decider.tick(T0 + 1.0)
