"""The pure token-bucket model: refill, all-or-nothing takes, tiers, corrections."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import RateLimitInfo, Tier
from services.admission.policy.bucket import (
    DEFAULT_TIERS,
    DIMENSIONS,
    BucketState,
    Group,
    Limit,
    TierConfig,
    adjust,
    assess,
    charge,
    decide,
    redis_clock,
    refill,
    take,
    take_together,
    time_until_available,
    time_until_full,
    ttl_ms,
)
from services.admission.policy.charges import Assessed

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
BASIC = TierConfig(Tier.BASIC, Limit(5, 1.0), Limit(1000, 100.0))
PRO = TierConfig(
    Tier.PRO, Limit(5, 1.0, burst_capacity=3, burst_rate=0.5), Limit(1000, 100.0, 500, 50.0)
)


def test_limit_validation() -> None:
    for bad in [(0, 1), (1, 0), (1, -1), (1, 1, -1, 1), (1, 1, 5, 0), (1, 1, 0, 5), (math.inf, 1)]:
        with pytest.raises(ValueError, match=r"finite|positive|negative|burst"):
            Limit(*bad)
    with pytest.raises(ValueError, match="basic"):
        TierConfig(Tier.BASIC, Limit(1, 1, 1, 1), Limit(1, 1))
    assert DEFAULT_TIERS[Tier.PRO].requests.burst_capacity > 0


def test_missing_state_starts_full_with_a_timestamp() -> None:
    assert refill(None, T0, PRO.requests) == BucketState(5, T0, 3)


def test_refill_is_linear_and_capped() -> None:
    s = BucketState(1.0, T0, 0.0)
    assert refill(s, T0 + 2.5, PRO.requests) == BucketState(3.5, T0 + 2.5, 1.25)
    assert refill(s, T0 + 100, PRO.requests) == BucketState(5, T0 + 100, 3)


def test_a_clock_stepping_back_refills_nothing_and_keeps_the_timestamp() -> None:
    s = BucketState(1.0, T0, 0.0)
    assert refill(s, T0 - 30, PRO.requests) == s
    assert refill(refill(s, T0 - 30, PRO.requests), T0 + 1, PRO.requests).tokens == 2.0


def test_basic_is_strict() -> None:
    state: BucketState | None = None
    outcomes = []
    for _ in range(7):
        outcome, t = take(state, 1, T0, BASIC.requests)
        state = t.state
        outcomes.append(outcome)
    assert outcomes == ["admit"] * 5 + ["reject"] * 2
    outcome, t = take(state, 1, T0 + 0.25, BASIC.requests)
    assert outcome == "reject"
    assert t.retry_after_s == pytest.approx(0.75)
    assert take(state, 1, T0 + 1, BASIC.requests)[0] == "admit"


def test_pro_degrades_above_baseline_then_rejects() -> None:
    state: BucketState | None = None
    outcomes = []
    for _ in range(10):
        outcome, t = take(state, 1, T0, PRO.requests)
        state = t.state
        outcomes.append(outcome)
    assert outcomes == ["admit"] * 5 + ["degrade"] * 3 + ["reject"] * 2


def test_a_cost_straddling_both_levels_drains_baseline_first() -> None:
    outcome, t = take(BucketState(2.0, T0, 3.0), 4, T0, PRO.requests)
    assert outcome == "degrade"
    assert t.state == BucketState(0.0, T0, 1.0)


def test_all_or_nothing_across_dimensions() -> None:
    decision, states = decide(BASIC, {}, T0, requests=1, tokens=1001)
    assert decision.outcome == "reject"
    assert decision.reason == "cost_exceeds_capacity"
    assert math.isinf(decision.retry_after_s)
    assert "Retry-After" not in decision.headers()
    assert states == {"requests": BucketState(5, T0, 0.0), "tokens": BucketState(1000, T0, 0.0)}

    decision, states = decide(BASIC, {"tokens": BucketState(10, T0)}, T0, requests=1, tokens=50)
    assert decision.outcome == "reject"
    assert decision.reason == "quota_exhausted"
    assert states["requests"].tokens == 5  # the request was not charged either
    assert decision.retry_after_s == pytest.approx(0.4)
    assert decision.dimensions["requests"].retry_after_s == 0.0


def test_headers() -> None:
    decision, _ = decide(BASIC, {"requests": BucketState(0.5, T0)}, T0, requests=1, tokens=10)
    assert decision.headers() == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "5",
        "Retry-After": "1",
    }
    assert decision.rate_limit_info() == RateLimitInfo(
        limit=5, remaining=0, reset_s=5, retry_after_s=1
    )
    huge = TierConfig(Tier.ENTERPRISE, Limit(1e12, 1e-6), Limit(1e12, 1e-6))
    info = decide(huge, {"requests": BucketState(0, T0)}, T0)[0].rate_limit_info()
    assert info == RateLimitInfo(limit=2**31, remaining=0, reset_s=86_400, retry_after_s=86_400)
    decision, _ = decide(BASIC, {}, T0, requests=1, tokens=900)
    # admitted: the dimension closest to empty binds
    assert decision.headers() == {
        "X-RateLimit-Limit": "1000",
        "X-RateLimit-Remaining": "100",
        "X-RateLimit-Reset": "9",
    }


def test_degraded_decision_reason() -> None:
    decision, _ = decide(PRO, {"requests": BucketState(0, T0, 3)}, T0)
    assert (decision.outcome, decision.reason, decision.allowed) == ("degrade", "burst", True)


def test_adjust_refunds_then_charges_within_bounds() -> None:
    lim = PRO.tokens
    s = BucketState(900, T0, 100)
    assert adjust(s, -50, T0, lim) == BucketState(950, T0, 100)
    assert adjust(s, -300, T0, lim) == BucketState(1000, T0, 300)
    assert adjust(s, -10_000, T0, lim) == BucketState(1000, T0, 500)
    assert adjust(s, 950, T0, lim) == BucketState(0.0, T0, 50)
    assert adjust(s, 10_000, T0, lim) == BucketState(0.0, T0, 0.0)
    assert adjust(None, -5, T0, lim) == BucketState(1000, T0, 500)
    with pytest.raises(ValueError, match="finite"):
        adjust(s, math.nan, T0, lim)


def test_costs_are_validated() -> None:
    with pytest.raises(ValueError, match="negative"):
        take(None, -1, T0, BASIC.requests)
    with pytest.raises(ValueError, match="parallel"):
        take_together([None], [1, 2], T0, [BASIC.requests])


def test_redis_clock() -> None:
    assert redis_clock(1_700_000_000, 123_456) == 1_700_000_000.123456


def test_ttl_covers_a_full_refill() -> None:
    s = BucketState(0.0, T0, 0.0)
    assert time_until_full(s, PRO.requests) == 6.0  # burst: 3 / 0.5
    assert ttl_ms(s, PRO.requests, margin_ms=1000) == 7000
    assert ttl_ms(BucketState(5, T0, 3), PRO.requests, margin_ms=250) == 250


# --- properties ----------------------------------------------------------------------------

limits = st.builds(
    Limit,
    capacity=st.floats(1, 1000),
    rate=st.floats(0.01, 100),
    burst_capacity=st.just(0.0),
    burst_rate=st.just(0.0),
) | st.builds(
    Limit,
    capacity=st.floats(1, 1000),
    rate=st.floats(0.01, 100),
    burst_capacity=st.floats(1, 1000),
    burst_rate=st.floats(0.01, 100),
)
steps = st.lists(
    st.tuples(st.floats(-1, 5), st.floats(0, 60), st.sampled_from(["take", "adjust"])),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150)
@given(limits, steps)
def test_never_admits_more_than_capacity_plus_refill(
    lim: Limit, ops: list[tuple[float, float, str]]
) -> None:
    state: BucketState | None = None
    now = T0
    admitted = 0.0
    refunded = 0.0
    start: float | None = None
    for dt, cost, kind in ops:
        now += dt  # dt < 0: the clock stepped back
        if kind == "take":
            outcome, t = take(state, cost, now, lim)
            if outcome != "reject":
                admitted += cost
            state = t.state
            assert t.remaining == math.floor(t.state.tokens + t.state.burst)
        else:
            delta = -cost if dt > 2 else cost
            refunded += max(0.0, -delta)
            state = adjust(state, delta, now, lim)
        assert 0.0 <= state.tokens <= lim.capacity
        assert 0.0 <= state.burst <= lim.burst_capacity
        start = state.ts if start is None else start  # the bucket's creation
        elapsed = state.ts - start
        bound = lim.total + (lim.rate + lim.burst_rate) * elapsed + refunded
        assert admitted <= bound * (1 + 1e-9) + 1e-9


@settings(max_examples=150)
@given(limits, st.floats(0, 2000), st.floats(0, 1), st.floats(0, 1))
def test_retry_after_is_when_the_cost_first_fits(
    lim: Limit, cost: float, a: float, b: float
) -> None:
    # Time origin 0: near an epoch timestamp doubles are 2.4e-7 s apart, which would
    # blur the boundary this test probes.
    state = BucketState(a * lim.capacity, 0.0, b * lim.burst_capacity)
    wait = time_until_available(state, cost, lim)
    if cost > lim.total:
        assert math.isinf(wait)
        return
    later = refill(state, wait * (1 + 1e-9) + 1e-12, lim)
    assert cost <= later.tokens + later.burst + 1e-12 * lim.total
    if wait > 1e-6:
        earlier = refill(state, wait * (1 - 1e-6), lim)
        assert cost > earlier.tokens + earlier.burst


@given(st.integers(1, 50), st.floats(0.1, 50), st.floats(0, 10))
def test_unit_costs_count_exactly(capacity: int, rate: float, elapsed: float) -> None:
    """Hammering with unit costs admits exactly floor(capacity + rate × elapsed)."""
    lim = Limit(capacity, rate)
    state = take(None, 0, T0, lim)[1].state
    admitted = 0
    ticks = 200
    for i in range(ticks + 1):
        now = T0 + elapsed * i / ticks
        while True:
            outcome, t = take(state, 1, now, lim)
            state = t.state
            if outcome == "reject":
                break
            admitted += 1
    assert admitted <= math.floor(capacity + rate * elapsed + 1e-9)
    # Drained to below one unit at every tick, the bucket never reaches its cap when
    # the capacity exceeds one unit plus a tick's refill: then nothing is lost either
    # (up to the rounding of epoch-sized timestamps, 2.4e-7 s per reading).
    if capacity >= 1 + rate * elapsed / ticks:
        assert admitted >= math.floor(capacity + rate * elapsed - 1e-2)


# -- a charge of a region's and a tenant's buckets together ------------------------------

REGION = TierConfig(Tier.BASIC, Limit(2, 1.0), Limit(1.0, 1.0))


def group(
    cfg: TierConfig, states: list[BucketState | None], requests: float, tokens: float
) -> Group:
    return (states, [requests, tokens], [cfg.requests, cfg.tokens])


@given(
    region_spent=st.integers(0, 4),
    tenant_spent=st.integers(0, 8),
    tokens=st.integers(0, 1500),
)
def test_a_charge_spends_in_every_group_or_in_none(
    region_spent: int, tenant_spent: int, tokens: int
) -> None:
    region_state: BucketState | None = None
    for _ in range(region_spent):
        region_state = charge([group(REGION, [region_state, None], 1, 0)], T0)[0][1][0].state
    tenant: list[BucketState | None] = [None, None]
    for _ in range(tenant_spent):
        _, takes = charge([group(PRO, tenant, 1, 10)], T0)[0]
        tenant = [t.state for t in takes]
    (r_out, r_takes), (t_out, t_takes) = charge(
        [group(REGION, [region_state, None], 1, 0), group(PRO, tenant, 1, tokens)], T0
    )
    alone_region, _ = charge([group(REGION, [region_state, None], 1, 0)], T0)[0]
    alone_tenant, _ = charge([group(PRO, tenant, 1, tokens)], T0)[0]
    assert (r_out, t_out) == (alone_region, alone_tenant)  # each group judged as itself
    spent = r_out != "reject" and t_out != "reject"
    before_r = refill(region_state, T0, REGION.requests)
    before_t = refill(tenant[0], T0, PRO.requests)
    assert (r_takes[0].state.tokens < before_r.tokens) == spent  # the region paid, or not
    assert (t_takes[0].state != before_t) == spent  # the tenant paid, or not


states = st.builds(BucketState, st.floats(0, 1000), st.floats(0, 2e9), st.floats(0, 1000))


@given(st.tuples(states, states), st.tuples(st.floats(0, 50), st.floats(0, 5000)), limits, limits)
def test_an_admitted_charge_assessed_when_read_equals_one_assessed_at_once(
    after: tuple[BucketState, BucketState],
    costs: tuple[float, float],
    requests: Limit,
    tokens: Limit,
) -> None:
    # As the quota script returns them: each bucket's tokens, ts and burst, flat, as text.
    figures = [repr(v).encode() for s in after for v in (s.tokens, s.ts, s.burst)]
    lazy = Assessed(figures, costs, (requests, tokens))
    eager = {
        d: assess(s, c, lim, allowed=True)
        for d, s, c, lim in zip(DIMENSIONS, after, costs, (requests, tokens), strict=True)
    }
    assert list(lazy) == list(DIMENSIONS)
    assert len(lazy) == len(DIMENSIONS)
    assert lazy == eager
    assert dict(lazy) == eager
