"""Admission settings: tier quotas default to bucket.DEFAULT_TIERS and may be overridden
in part from the environment."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from schemas import Tier
from services.admission.policy.bucket import DEFAULT_TIERS, Limit
from services.admission.settings import AdmissionSettings

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("SEAWALL_"):
            monkeypatch.delenv(key)


def test_defaults_are_the_bucket_models() -> None:
    s = AdmissionSettings(_env_file=None)
    assert s.tier_configs() == dict(DEFAULT_TIERS)
    assert (s.small_pool, s.enterprise_pools) == ("small", {})


def test_one_leaf_overrides_keep_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_QUOTA_BASIC__REQUESTS__CAPACITY", "5")
    monkeypatch.setenv("SEAWALL_QUOTA_PRO", '{"tokens": {"rate": 123}}')
    s = AdmissionSettings(_env_file=None)
    basic, pro = s.tier_config(Tier.BASIC), s.tier_config(Tier.PRO)
    assert basic.requests == Limit(5, DEFAULT_TIERS[Tier.BASIC].requests.rate)
    assert basic.tokens == DEFAULT_TIERS[Tier.BASIC].tokens
    default_tokens = DEFAULT_TIERS[Tier.PRO].tokens
    assert pro.tokens == Limit(
        default_tokens.capacity, 123, default_tokens.burst_capacity, default_tokens.burst_rate
    )
    assert s.tier_config(Tier.ENTERPRISE) == DEFAULT_TIERS[Tier.ENTERPRISE]


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            {
                "SEAWALL_QUOTA_BASIC__REQUESTS__BURST_CAPACITY": "5",
                "SEAWALL_QUOTA_BASIC__REQUESTS__BURST_RATE": "1",
            },
            "strict bucket",
        ),
        ({"SEAWALL_QUOTA_PRO__TOKENS__RATE": "0"}, "greater than 0"),
        ({"SEAWALL_SMALL_POOL": "tiny"}, "small_pool"),
        (
            {
                "SEAWALL_POOLS": "main",
                "SEAWALL_SMALL_POOL": "main",
                "SEAWALL_ENTERPRISE_POOLS": '{"main": "gold"}',
            },
            "enterprise_pools",
        ),
    ],
)
def test_inconsistent_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match=match):
        AdmissionSettings(_env_file=None)


def test_a_dedicated_enterprise_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_POOLS", "main,small,gold")
    monkeypatch.setenv("SEAWALL_ENTERPRISE_POOLS", '{"main": "gold"}')
    assert AdmissionSettings(_env_file=None).enterprise_pools == {"main": "gold"}
