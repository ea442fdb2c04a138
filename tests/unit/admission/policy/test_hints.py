"""Which rejections become quota hints, and that a hint never refuses what the bucket
would admit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import QuotaHint, RateLimitInfo, Tier
from services.admission.policy.bucket import DEFAULT_TIERS, BucketState, Dimension, decide
from services.admission.policy.hints import HintThrottle, clear_hint, hint_for

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def drain(tier: Tier, tokens: float = 0.0) -> tuple[dict[Dimension, BucketState | None], float]:
    """A tenant's buckets after requests at ``T0`` until one is refused."""
    config = DEFAULT_TIERS[tier]
    states: dict[Dimension, BucketState | None] = {"requests": None, "tokens": None}
    for _ in range(10_000):
        decision, new = decide(config, states, T0, tokens=tokens)
        if decision.outcome == "reject":
            return states, T0
        states = dict(new)
    raise AssertionError("the bucket never emptied")


@pytest.mark.parametrize("tier", list(Tier))
def test_an_empty_requests_bucket_hints_until_it_holds_one_request(tier: Tier) -> None:
    config = DEFAULT_TIERS[tier]
    states, now = drain(tier)
    decision, _ = decide(config, states, now)
    hint = hint_for("acme", decision)
    assert hint is not None
    assert hint.tenant == "acme"
    assert hint.issued_at == now
    assert hint.until == pytest.approx(now + decision.dimensions["requests"].retry_after_s)
    assert hint.rate_limit.remaining == 0
    # within a microsecond of ``until`` the requests bucket pays again (floating point
    # leaves ``until`` a hair early, never late: the hint refuses no longer than needed)
    assert decide(config, states, hint.until + 1e-6)[0].outcome != "reject"


def test_a_rejection_on_tokens_alone_hints_nothing() -> None:
    """The token dimension is refunded and a smaller request may still fit it."""
    config = DEFAULT_TIERS[Tier.BASIC]
    decision, _ = decide(config, {}, T0, tokens=config.tokens.capacity * 2)
    assert decision.outcome == "reject"
    assert decision.reason == "cost_exceeds_capacity"
    assert hint_for("acme", decision) is None
    states, now = drain(Tier.BASIC, tokens=config.tokens.capacity / 4)  # tokens run out first
    decision, _ = decide(config, states, now, tokens=config.tokens.capacity / 4)
    assert decision.outcome == "reject"
    assert decision.dimensions["requests"].retry_after_s == 0
    assert hint_for("acme", decision) is None


def test_admitted_and_degraded_decisions_hint_nothing() -> None:
    assert hint_for("acme", decide(DEFAULT_TIERS[Tier.PRO], {}, T0)[0]) is None


@settings(max_examples=80, deadline=None)
@given(
    tier=st.sampled_from(list(Tier)),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=300),
    token_costs=st.lists(st.floats(0.0, 5_000.0), min_size=1, max_size=300),
    later=st.floats(0.0, 1.0, exclude_max=True),
    asked=st.floats(0.0, 50_000.0),
)
def test_no_request_is_admitted_before_a_hints_until(
    tier: Tier, gaps: list[float], token_costs: list[float], later: float, asked: float
) -> None:
    """Whatever came before, whatever is asked: before ``until`` the tenant's bucket
    rejects every request (the hint refuses only what the authority would refuse)."""
    config = DEFAULT_TIERS[tier]
    states: dict[Dimension, BucketState | None] = {}
    now = T0
    for gap, tokens in zip(gaps, token_costs, strict=False):
        now += gap
        decision, new = decide(config, states, now, tokens=tokens)
        hint = hint_for("acme", decision)
        if hint is not None:
            at = hint.issued_at + later * (hint.until - hint.issued_at)
            assert decide(config, states, at, tokens=asked)[0].outcome == "reject"
        if decision.outcome != "reject":
            states = dict(new)


def hint(tenant: str, until: float) -> QuotaHint:
    info = RateLimitInfo(limit=20, remaining=0, reset_s=20.0, retry_after_s=1.0)
    return QuotaHint(tenant=tenant, until=until, issued_at=T0, rate_limit=info)


def test_the_throttle_publishes_a_tenants_hint_only_when_it_extends_the_last() -> None:
    throttle = HintThrottle(min_extension_s=0.25, max_tenants=2)
    assert throttle.admit(hint("a", T0 + 1.0))
    assert not throttle.admit(hint("a", T0 + 1.1))  # a flood's next rejections
    assert throttle.admit(hint("a", T0 + 1.3))
    assert throttle.admit(hint("b", T0 + 1.0))
    assert not throttle.admit(hint("c", T0 + 1.0))  # full of live hints
    late = QuotaHint(
        tenant="c", until=T0 + 3.0, issued_at=T0 + 2.0, rate_limit=hint("c", 0).rate_limit
    )
    assert throttle.admit(late)  # a and b have passed: forgotten
    assert len(throttle) == 1


def test_a_clear_hint_says_until_when_it_was_issued_and_the_throttle_forgets() -> None:
    cleared = clear_hint("a", T0)
    assert (cleared.tenant, cleared.until, cleared.issued_at) == ("a", T0, T0)
    throttle = HintThrottle()
    assert throttle.admit(hint("a", T0 + 1.0))
    assert not throttle.admit(hint("a", T0 + 1.1))
    throttle.forget("a")  # the tenant's quota changed
    assert throttle.admit(hint("a", T0 + 1.1))
