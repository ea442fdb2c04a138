import pytest

from services.workers.engine.base import EngineLimits
from services.workers.engine.validate import (
    DEFAULT_THRESHOLDS,
    RiskThresholds,
    SettingWarning,
    validate_engine_settings,
    validate_limits,
)

pytestmark = pytest.mark.unit


def _check(
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = 8192,
    block_size: int = 32,
    gpu_memory_utilization: float | None = 0.9,
    thresholds: RiskThresholds = DEFAULT_THRESHOLDS,
) -> tuple[SettingWarning, ...]:
    """Validate seed 1's settings (2×A100, all inside the thresholds) with overrides."""
    return validate_engine_settings(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        thresholds=thresholds,
    )


def _flagged(warnings: tuple[SettingWarning, ...]) -> list[tuple[str, float, float]]:
    return [(w.setting, w.value, w.threshold) for w in warnings]


def test_seed_one_settings_pass() -> None:
    assert _check() == ()


def test_values_at_the_thresholds_pass() -> None:
    assert (
        _check(
            max_num_seqs=80,
            max_num_batched_tokens=12_000,
            block_size=16,
            gpu_memory_utilization=0.95,
        )
        == ()
    )


def test_seed_two_max_num_seqs_warns_of_latency_spikes() -> None:
    warnings = _check(max_num_seqs=512, max_num_batched_tokens=None)
    assert _flagged(warnings) == [("max_num_seqs", 512, 80)]
    assert "latency spikes" in warnings[0].reason


def test_each_risk_is_reported_with_its_threshold() -> None:
    warnings = validate_engine_settings(
        max_num_seqs=81, max_num_batched_tokens=12_001, block_size=8, gpu_memory_utilization=0.97
    )
    assert _flagged(warnings) == [
        ("max_num_seqs", 81, 80),
        ("max_num_batched_tokens", 12_001, 12_000),
        ("block_size", 8, 16),
        ("gpu_memory_utilization", 0.97, 0.95),
    ]
    reasons = [w.reason for w in warnings]
    assert "OOM risk" in reasons[1]
    assert "half efficiency" in reasons[2]


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.2])
def test_gpu_memory_utilization_outside_unit_interval_is_invalid(utilization: float) -> None:
    warnings = _check(gpu_memory_utilization=utilization)
    assert _flagged(warnings) == [("gpu_memory_utilization", utilization, 1.0)]
    assert "(0, 1]" in warnings[0].reason


def test_full_memory_is_valid_but_risky() -> None:
    warnings = _check(gpu_memory_utilization=1.0)
    assert _flagged(warnings) == [("gpu_memory_utilization", 1.0, 0.95)]


def test_token_budget_below_batch_size_is_flagged() -> None:
    warnings = _check(max_num_seqs=64, max_num_batched_tokens=32)
    assert _flagged(warnings) == [("max_num_batched_tokens", 32, 64)]
    assert "refuse to start" in warnings[0].reason


def test_zero_sequences_is_invalid() -> None:
    warnings = _check(max_num_seqs=0)
    assert _flagged(warnings) == [("max_num_seqs", 0, 1)]


def test_unset_settings_are_not_checked() -> None:
    assert (
        validate_engine_settings(
            max_num_seqs=64, max_num_batched_tokens=None, block_size=16, gpu_memory_utilization=None
        )
        == ()
    )


def test_thresholds_are_configurable() -> None:
    strict = RiskThresholds(max_num_seqs=32)
    warnings = _check(thresholds=strict)
    assert _flagged(warnings) == [("max_num_seqs", 64, 32)]


def test_validate_limits_reads_the_engine_limits() -> None:
    limits = EngineLimits(
        max_num_seqs=128,
        max_num_batched_tokens=16_384,
        block_size=16,
        gpu_memory_utilization=0.9,
        kv_capacity_tokens=100_000,
        max_model_len=4096,
    )
    assert [w.setting for w in validate_limits(limits)] == [
        "max_num_seqs",
        "max_num_batched_tokens",
    ]


def test_warning_renders_for_the_log() -> None:
    (warning,) = _check(block_size=8)
    assert str(warning).startswith("block_size=8 (threshold 16): half efficiency")
