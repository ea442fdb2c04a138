"""The control events operators publish with ``seawall quota`` and ``seawall region``."""

from __future__ import annotations

import pytest

from schemas import Tier
from seawall import steer
from services.admission.policy.bucket import DEFAULT_TIERS
from services.admission.policy.overrides import overridden
from services.common.control_state import in_force

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def test_a_quota_override_holds_for_its_ttl_and_says_who_and_why() -> None:
    event = steer.quota_set(
        "acme",
        requests_per_s=5,
        tokens_per_minute=6_000,
        burst=None,
        ttl_s=600,
        reason="launch day",
        issuer=steer.operator("alice"),
        now=T0,
    )
    assert (event.control_key, event.issuer, event.evidence.reason) == (
        "quota_override/tenant:acme",
        "operator:alice",
        "launch day",
    )
    assert (event.requests_per_s, event.tokens_per_s, event.burst) == (5, 100.0, None)
    assert event.expires_at == T0 + 600
    assert in_force(event, T0 + 599)
    assert not in_force(event, T0 + 601)
    base = DEFAULT_TIERS[Tier.BASIC]
    config = overridden(base, event)
    assert config is not None
    assert (config.requests.rate, config.tokens.rate) == (5, 100.0)
    assert config.requests.capacity == base.requests.capacity  # no --burst: the tier's


def test_a_later_command_wins_and_a_clear_restores_the_tier() -> None:
    who = steer.operator("bob")
    first = steer.quota_set(
        "acme",
        requests_per_s=0,
        tokens_per_minute=None,
        burst=None,
        ttl_s=60,
        reason="abuse",
        issuer=who,
        now=T0,
    )
    cleared = steer.quota_clear("acme", reason="resolved", issuer=who, now=T0 + 1)
    assert cleared.control_key == first.control_key
    assert cleared.seq > first.seq
    assert overridden(DEFAULT_TIERS[Tier.PRO], first) is None  # 0: suspended
    assert overridden(DEFAULT_TIERS[Tier.PRO], cleared) == DEFAULT_TIERS[Tier.PRO]


@pytest.mark.parametrize("ttl", [0.0, -1.0, 86_401.0])
def test_a_ttl_outside_a_day_is_refused(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl"):
        steer.region_throttle(
            "eu", rate_per_s=1, ttl_s=ttl, reason="r", issuer="operator:x", now=T0
        )


def test_a_quota_without_terms_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        steer.quota_set(
            "acme",
            requests_per_s=None,
            tokens_per_minute=None,
            burst=None,
            ttl_s=60,
            reason="r",
            issuer="operator:x",
            now=T0,
        )


def test_region_throttle_and_lift() -> None:
    who = steer.operator("carol")
    throttle = steer.region_throttle(
        "eu", rate_per_s=2, ttl_s=300, reason="surge", issuer=who, now=T0
    )
    lift = steer.region_throttle(
        "eu", rate_per_s=None, ttl_s=300, reason="calm", issuer=who, now=T0 + 1
    )
    assert (throttle.control_key, throttle.rate_per_s, throttle.valid_for_s) == (
        "region_throttle/region:eu",
        2,
        300,
    )
    assert (lift.control_key, lift.rate_per_s) == ("region_throttle/region:eu", None)


def test_the_issuer_is_an_identifier_whatever_the_login() -> None:
    assert steer.operator("jane doe (ops)") == "operator:jane-doe--ops-"
