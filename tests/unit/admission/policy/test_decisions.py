"""Admission's per-request decisions (decisions.py): every tier, breaker level, degradation
rung, region throttle, quota override, deadline and the Redis-down policy per tier."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    BreakerLevel,
    BreakerState,
    ControlEvent,
    Degradation,
    DegradationLevel,
    Evidence,
    InferenceRequest,
    Priority,
    QuotaOverride,
    RateLimitInfo,
    ReasonCode,
    RegionThrottle,
    ReplyStatus,
    SamplingParams,
    Tier,
    TrafficSplit,
)
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import BucketState, Limit, TierConfig, decide
from services.admission.policy.config import PolicyConfig
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.outcomes import Accepted, Admit, Reply, Screened
from services.admission.policy.overrides import quota_override, region_bucket
from services.admission.policy.routing import worker_share
from services.admission.quota import on_redis_down
from services.common.control_state import ControlState

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
TIERS = {
    Tier.BASIC: TierConfig(Tier.BASIC, Limit(2, 1.0), Limit(10_000, 100.0)),
    Tier.PRO: TierConfig(Tier.PRO, Limit(2, 1.0, 2, 1.0), Limit(10_000, 100.0, 5_000, 50.0)),
    Tier.ENTERPRISE: TierConfig(Tier.ENTERPRISE, Limit(50, 10.0), Limit(100_000, 1_000.0)),
}
CONFIG = PolicyConfig(
    tiers=TIERS,
    scavenger_tiers=frozenset({Tier.BASIC, Tier.PRO}),
    pools=("main", "small", "vip"),
    small_pool="small",
    enterprise_pools={"main": "vip"},
    max_tokens_cap=100,
    rate_limit_factor=0.5,
    breaker_retry_after_s=7.0,
    quota_retry_after_s=2.0,
)
_seq = itertools.count(1)


def request(
    *,
    tier: Tier = Tier.PRO,
    pool: str = "main",
    max_tokens: int = 50,
    region: str = "",
    deadline: float | None = None,
    tenant: str = "acme",
) -> InferenceRequest:
    return InferenceRequest.model_validate(
        {
            "request_id": "r1",
            "tenant": tenant,
            "tier": tier,
            "pool": pool,
            "prompt": "hello world",
            "sampling": {"max_tokens": max_tokens},
            "reply_to": "replies",
            "created_at": NOW - 10,
            "deadline_at": deadline,
            "client": {"region": region},
        }
    )


def common(scope: str) -> dict[str, Any]:
    return {"scope": scope, "seq": next(_seq), "issued_at": NOW, "evidence": Evidence(reason="t")}


def breaker(
    scope: str,
    level: BreakerLevel,
    state: Literal["closed", "open", "half_open"] = "open",
    probes: int = 0,
) -> BreakerState:
    return BreakerState(**common(scope), state=state, level=level, probe_requests=probes)


def degradation(
    scope: str, level: int, small_pool: str | None = None, cap: int | None = None
) -> DegradationLevel:
    return DegradationLevel(**common(scope), level=level, small_pool=small_pool, max_tokens_cap=cap)


def throttle(region: str, rate: float | None) -> RegionThrottle:
    return RegionThrottle(**common(f"region:{region}"), region=region, rate_per_s=rate)


def override(tenant: str, **values: float | None) -> QuotaOverride:
    return QuotaOverride(**common(f"tenant:{tenant}"), tenant=tenant, **values)


def control(*events: ControlEvent) -> ControlState:
    state = ControlState(ManualClock(NOW))
    for e in events:
        state.apply(e)
    return state


def policy() -> AdmissionPolicy:
    return AdmissionPolicy(CONFIG)


def accepted(
    pool: str = "main", cls: Priority = Priority.STANDARD, degraded: bool = False
) -> Accepted:
    return Accepted(pool, cls, degraded, 66.0)


def reply_of(verdict: object) -> tuple[ReplyStatus, ReasonCode]:
    assert isinstance(verdict, Reply)
    return verdict.reply.status, verdict.reply.reason


# -- screening -------------------------------------------------------------------------


def test_screen_passes_a_plain_request_with_its_quota_charge() -> None:
    req = request(max_tokens=50)
    got = policy().screen(req, Priority.STANDARD, control(), NOW)
    assert isinstance(got, Screened)
    assert got.pool == "main"
    assert got.tenant.tenant == "acme"
    assert got.tenant.config == TIERS[Tier.PRO]
    assert (got.tenant.requests, got.tenant.tokens) == (1, 2 + 50)  # "hello world" + output
    assert got.region is None
    # Ingress's count, where it gave one, is what is reserved (nothing counted again).
    counted = policy().screen(
        req.model_copy(update={"prompt_tokens": 40}), Priority.STANDARD, control(), NOW
    )
    assert isinstance(counted, Screened)
    assert (counted.prompt_tokens, counted.tenant.tokens) == (40, 40 + 50)


def test_enterprise_goes_to_the_dedicated_pool_of_the_model_it_asked_for() -> None:
    dedicated = policy().screen(request(tier=Tier.ENTERPRISE), Priority.VIP, control(), NOW)
    assert isinstance(dedicated, Screened)
    assert dedicated.pool == "vip"  # main's dedicated pool, serving main's model
    same_model = policy().screen(
        request(tier=Tier.ENTERPRISE, pool="small"), Priority.VIP, control(), NOW
    )
    assert isinstance(same_model, Screened)
    assert same_model.pool == "small"  # no dedicated pool for it: never another model
    pro = policy().screen(request(), Priority.STANDARD, control(), NOW)
    assert isinstance(pro, Screened)
    assert pro.pool == "main"


@pytest.mark.parametrize(
    ("deadline", "expired"), [(None, False), (NOW + 0.001, False), (NOW, True), (NOW - 5, True)]
)
def test_a_request_past_its_deadline_is_expired_without_quota(
    deadline: float | None, expired: bool
) -> None:
    got = policy().screen(request(deadline=deadline), Priority.STANDARD, control(), NOW)
    if expired:
        assert reply_of(got) == (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED)
        assert isinstance(got, Reply)
        assert got.reply.rate_limit is None
    else:
        assert isinstance(got, Screened)


def test_an_unknown_pool_is_rejected() -> None:
    got = policy().screen(request(pool="nowhere"), Priority.STANDARD, control(), NOW)
    assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.INVALID_REQUEST)


BREAKER_CASES = [
    # (level, state, probes, refused at screen)
    (BreakerLevel.NONE, "closed", 0, False),
    (BreakerLevel.LOG, "open", 0, False),
    (BreakerLevel.RATE_LIMIT, "open", 0, False),
    (BreakerLevel.REJECT_NEW, "open", 0, True),
    (BreakerLevel.EMERGENCY, "open", 0, True),
    (BreakerLevel.REJECT_NEW, "half_open", 2, False),
    (BreakerLevel.REJECT_NEW, "half_open", 0, True),
    (BreakerLevel.REJECT_NEW, "closed", 0, False),  # closed: the level is history
]


@pytest.mark.parametrize(("level", "state", "probes", "refused"), BREAKER_CASES)
@pytest.mark.parametrize("scope", ["pool:main", "fleet"])
def test_breaker_levels_at_screening(
    level: BreakerLevel,
    state: Literal["closed", "open", "half_open"],
    probes: int,
    refused: bool,
    scope: str,
) -> None:
    ctl = control(breaker(scope, level, state, probes))
    got = policy().screen(request(), Priority.STANDARD, ctl, NOW)
    if refused:
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.BREAKER_OPEN)
        assert isinstance(got, Reply)
        assert got.reply.rate_limit is not None
        assert got.reply.rate_limit.retry_after_s == 7
    else:
        assert isinstance(got, Screened)


@pytest.mark.parametrize(
    ("level", "factor"),
    [
        (BreakerLevel.NONE, 1.0),
        (BreakerLevel.LOG, 1.0),
        (BreakerLevel.RATE_LIMIT, 0.5),
        (BreakerLevel.REJECT_NEW, 1.0),
    ],
)
def test_a_rate_limit_breaker_paces_the_pool(level: BreakerLevel, factor: float) -> None:
    gate = policy().gate("main", control(breaker("pool:main", level)))
    assert gate.factor == factor
    assert gate.refuse == (level >= BreakerLevel.REJECT_NEW)
    assert gate.level == level


def test_the_pools_own_breaker_takes_precedence_over_the_fleets() -> None:
    ctl = control(
        breaker("fleet", BreakerLevel.REJECT_NEW), breaker("pool:main", BreakerLevel.NONE, "closed")
    )
    assert isinstance(policy().screen(request(), Priority.STANDARD, ctl, NOW), Screened)
    small = request(pool="small")
    assert (
        reply_of(policy().screen(small, Priority.STANDARD, ctl, NOW))[1] is ReasonCode.BREAKER_OPEN
    )


def test_the_breaker_of_the_destination_decides_after_diversion() -> None:
    ctl = control(degradation("pool:main", 1), breaker("pool:small", BreakerLevel.REJECT_NEW))
    p = policy()
    assert reply_of(p.screen(request(), Priority.STANDARD, ctl, NOW))[1] is ReasonCode.BREAKER_OPEN
    assert isinstance(p.screen(request(), Priority.VIP, ctl, NOW), Screened)  # VIP stays on main


@pytest.mark.parametrize(
    ("rate", "outcome", "capacity"),
    [(None, "none", None), (0.0, "rejected", None), (0.5, "bucket", 1.0), (20.0, "bucket", 20.0)],
)
def test_region_throttles(rate: float | None, outcome: str, capacity: float | None) -> None:
    ctl = control(throttle("eu-west", rate))
    got = policy().screen(request(region="eu-west"), Priority.STANDARD, ctl, NOW)
    if outcome == "rejected":
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.REGION_THROTTLED)
        assert isinstance(got, Reply)
        assert got.reply.rate_limit is not None
        return
    assert isinstance(got, Screened)
    if outcome == "none":
        assert got.region is None
        return
    assert got.region is not None
    assert got.region.tenant == region_bucket("eu-west")
    assert got.region.config.requests == Limit(capacity or 0, rate or 0)
    assert (got.region.requests, got.region.tokens) == (1, 0)
    # other regions and unknown regions are not throttled
    for region in ("us-east", ""):
        other = policy().screen(request(region=region), Priority.STANDARD, ctl, NOW)
        assert isinstance(other, Screened)
        assert other.region is None


def test_the_latest_throttle_of_a_region_wins() -> None:
    """The controller's hotspot throttle, then the operator's lift: lifted."""
    hotspot = RegionThrottle(**common("hotspot:eu"), region="eu", rate_per_s=5.0)
    lifted = RegionThrottle(**common("region:eu"), region="eu", rate_per_s=None)
    got = policy().screen(request(region="eu"), Priority.STANDARD, control(hotspot, lifted), NOW)
    assert isinstance(got, Screened)
    assert got.region is None


def test_a_throttle_under_a_scope_of_its_own_choosing_is_ignored() -> None:
    """Anyone who can write the control topic could pin a region (or a tenant) under a
    scope no lift reaches: only the exact scopes count."""
    pinned = RegionThrottle(**common("region:eu/x"), region="eu", rate_per_s=0.0)
    got = policy().screen(request(region="eu"), Priority.STANDARD, control(pinned), NOW)
    assert isinstance(got, Screened)
    assert got.region is None
    stuck = QuotaOverride(**common("tenant:acme/x"), tenant="acme", requests_per_s=0.0)
    assert quota_override(control(stuck), "acme", NOW) is None


def test_region_bucket_names_are_safe_and_distinct() -> None:
    names = {region_bucket(r) for r in ("eu", "e{u}", "e u", "e%7Bu%7D", "eu/1")}
    assert len(names) == 5
    assert not any("{" in n or "}" in n for n in names)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"requests_per_s": 9.0}, (Limit(2, 9.0, 2, 1.0), Limit(10_000, 100.0, 5_000, 50.0))),
        ({"tokens_per_s": 7.0}, (Limit(2, 1.0, 2, 1.0), Limit(10_000, 7.0, 5_000, 50.0))),
        ({"burst": 30.0}, (Limit(30, 1.0, 2, 1.0), Limit(10_000, 100.0, 5_000, 50.0))),
        ({"requests_per_s": 0.0}, None),
        ({"tokens_per_s": 0.0}, None),
        ({"burst": 0.0}, None),
    ],
)
def test_quota_overrides(values: dict[str, float], expected: tuple[Limit, Limit] | None) -> None:
    ctl = control(override("acme", **values))
    got = policy().screen(request(), Priority.STANDARD, ctl, NOW)
    if expected is None:
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED)
        return
    assert isinstance(got, Screened)
    assert (got.tenant.config.requests, got.tenant.config.tokens) == expected
    other = policy().screen(request(tenant="globex"), Priority.STANDARD, ctl, NOW)
    assert isinstance(other, Screened)
    assert other.tenant.config == TIERS[Tier.PRO]


def test_an_expired_override_no_longer_applies() -> None:
    o = QuotaOverride(**common("tenant:acme"), tenant="acme", requests_per_s=0.0, expires_at=NOW)
    got = policy().screen(request(), Priority.STANDARD, control(o), NOW)
    assert isinstance(got, Screened)
    assert got.tenant.config == TIERS[Tier.PRO]


# -- judging the quota decisions -------------------------------------------------------


def quota_after(tier: Tier, spent: int) -> Any:
    """The real decision of the pure bucket model after ``spent`` earlier requests."""
    states: dict[Any, BucketState | None] = {}
    decision = None
    for _ in range(spent + 1):
        decision, states = decide(TIERS[tier], states, NOW, 1, 10)  # type: ignore[assignment]
    return decision


TIER_CASES = [
    # tier, earlier requests, verdict, reason, class it waits in
    (Tier.BASIC, 0, "accepted", None, Priority.BULK),
    (Tier.BASIC, 1, "accepted", None, Priority.BULK),
    (Tier.BASIC, 2, "scavenger", None, Priority.BULK),  # over quota: waits for idle room
    (Tier.PRO, 1, "accepted", None, Priority.STANDARD),
    (Tier.PRO, 2, "degraded", None, Priority.BULK),  # the burst level: one class lower
    (Tier.PRO, 3, "degraded", None, Priority.BULK),
    (Tier.PRO, 4, "scavenger", None, Priority.BULK),
    (Tier.ENTERPRISE, 49, "accepted", None, Priority.VIP),
    (Tier.ENTERPRISE, 50, "rejected", ReasonCode.QUOTA_EXCEEDED, None),
]
_CLASS = {Tier.BASIC: Priority.BULK, Tier.PRO: Priority.STANDARD, Tier.ENTERPRISE: Priority.VIP}


@pytest.mark.parametrize(("tier", "spent", "verdict", "reason", "cls"), TIER_CASES)
def test_tier_behaviour(
    tier: Tier, spent: int, verdict: str, reason: ReasonCode | None, cls: Priority | None
) -> None:
    req = request(tier=tier)
    screened = policy().screen(req, _CLASS[tier], control(), NOW)
    assert isinstance(screened, Screened)
    got = policy().judge(req, _CLASS[tier], screened, NOW, quota_after(tier, spent))
    if verdict == "rejected":
        assert reply_of(got) == (ReplyStatus.REJECTED, reason)
        assert isinstance(got, Reply)
        assert_refusal_figures(got.reply.rate_limit, tier)
        return
    assert isinstance(got, Accepted)
    assert got.cls is cls
    assert got.quota_degraded == (verdict == "degraded")
    assert got.scavenger == (verdict == "scavenger")
    if got.scavenger:
        assert got.reserved_tokens == 0  # the bucket refused it: nothing was charged
        assert_refusal_figures(got.refusal, tier)  # kept for the 429 if it is shed
        assert got.cost == Cost(screened.prompt_tokens, req.sampling.max_tokens)
    else:
        assert got.reserved_tokens == screened.tenant.tokens


def assert_refusal_figures(info: RateLimitInfo | None, tier: Tier) -> None:
    assert info is not None
    assert info.limit == math.floor(TIERS[tier].requests.total)
    assert info.remaining == 0
    assert info.retry_after_s >= 1


@pytest.mark.parametrize(("tier", "spent"), [(Tier.BASIC, 2), (Tier.PRO, 4)])
def test_strict_mode_refuses_over_quota_at_once(tier: Tier, spent: int) -> None:
    strict = AdmissionPolicy(dataclasses.replace(CONFIG, scavenger_tiers=frozenset()))
    req = request(tier=tier)
    screened = strict.screen(req, _CLASS[tier], control(), NOW)
    assert isinstance(screened, Screened)
    got = strict.judge(req, _CLASS[tier], screened, NOW, quota_after(tier, spent))
    assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED)
    assert isinstance(got, Reply)
    assert_refusal_figures(got.reply.rate_limit, tier)


def test_a_scavenger_is_served_scavenged_or_shed_with_its_refusal() -> None:
    p = policy()
    req = request(tier=Tier.BASIC)
    screened = p.screen(req, Priority.BULK, control(), NOW)
    assert isinstance(screened, Screened)
    got = p.judge(req, Priority.BULK, screened, NOW, quota_after(Tier.BASIC, 2))
    assert isinstance(got, Accepted)
    admit = p.release(req, got.cls, got, control(), NOW)
    assert isinstance(admit, Admit)
    assert admit.reason is ReasonCode.SCAVENGED
    assert admit.dispatch.degradation.scavenged
    shed = p.shed(req, got, NOW + 1)
    assert reply_of(shed) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED)
    assert shed.reply.rate_limit == got.refusal  # the figures of its refusal, truthfully


def test_a_request_that_can_never_fit_is_rejected_without_retry_after() -> None:
    req = request(tier=Tier.BASIC, max_tokens=20_000)
    screened = policy().screen(req, Priority.BULK, control(), NOW)
    assert isinstance(screened, Screened)
    decision, _ = decide(TIERS[Tier.BASIC], {}, NOW, 1, screened.tenant.tokens)
    got = policy().judge(req, Priority.BULK, screened, NOW, decision)
    assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED)
    assert isinstance(got, Reply)
    assert got.reply.rate_limit is not None
    assert got.reply.rate_limit.retry_after_s == 0


@pytest.mark.parametrize(
    ("tier", "verdict"),
    [(Tier.ENTERPRISE, "admit"), (Tier.PRO, "degrade"), (Tier.BASIC, "reject")],
)
def test_redis_down_policy_per_tier(tier: Tier, verdict: str) -> None:
    req = request(tier=tier)
    screened = policy().screen(req, _CLASS[tier], control(), NOW)
    assert isinstance(screened, Screened)
    got = policy().judge(req, _CLASS[tier], screened, NOW, on_redis_down(tier, 2.0))
    if verdict == "reject":
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_UNAVAILABLE)
        assert isinstance(got, Reply)
        assert got.reply.rate_limit is not None
        assert got.reply.rate_limit.retry_after_s == 2
        return
    assert isinstance(got, Accepted)
    assert got.quota_degraded == (verdict == "degrade")
    assert got.reserved_tokens == 0  # nothing was charged, nothing to correct


def test_a_region_refusal_comes_first_whatever_its_tenant_could_pay() -> None:
    req = request(region="eu")
    screened = policy().screen(req, Priority.STANDARD, control(throttle("eu", 1.0)), NOW)
    assert isinstance(screened, Screened)
    assert screened.region is not None
    states: dict[Any, BucketState | None] = {}
    region = None
    for _ in range(2):
        region, states = decide(screened.region.config, states, NOW, 1, 0)  # type: ignore[assignment]
    tenant, _ = decide(screened.tenant.config, {}, NOW, 1, screened.tenant.tokens)
    assert tenant.allowed
    got = policy().judge(req, Priority.STANDARD, screened, NOW, tenant, region)
    assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.REGION_THROTTLED)
    assert isinstance(got, Reply)
    assert got.reply.rate_limit is not None
    assert got.reply.rate_limit.limit == 1


# -- release at dispatch ---------------------------------------------------------------

LADDER = [
    # scope, level, class, max_tokens, expected pool, expected degradation, reason
    ("pool:main", 0, Priority.STANDARD, 500, "main", Degradation(), ReasonCode.NONE),
    (
        "pool:main",
        1,
        Priority.STANDARD,
        500,
        "small",
        Degradation(level=1, diverted_from="main"),
        ReasonCode.DEGRADED_SMALL_MODEL,
    ),
    ("pool:main", 1, Priority.VIP, 500, "main", Degradation(), ReasonCode.NONE),
    (
        "fleet",
        1,
        Priority.BULK,
        50,
        "small",
        Degradation(level=1, diverted_from="main"),
        ReasonCode.DEGRADED_SMALL_MODEL,
    ),
    (
        "pool:main",
        2,
        Priority.STANDARD,
        500,
        "small",
        Degradation(level=2, diverted_from="main", max_tokens_cap=100),
        ReasonCode.DEGRADED_TRUNCATED,
    ),
    (
        "pool:main",
        2,
        Priority.STANDARD,
        100,  # not long: untouched but for the diversion
        "small",
        Degradation(level=1, diverted_from="main"),
        ReasonCode.DEGRADED_SMALL_MODEL,
    ),
    (
        "pool:main",
        2,
        Priority.VIP,
        500,
        "main",
        Degradation(level=2, max_tokens_cap=100),
        ReasonCode.DEGRADED_TRUNCATED,
    ),
    ("pool:main", 2, Priority.VIP, 50, "main", Degradation(), ReasonCode.NONE),
    (
        "pool:main",
        3,
        Priority.VIP,
        50,
        "main",
        Degradation(level=3, static_reply=True),
        ReasonCode.DEGRADED_STATIC,
    ),
    (
        "fleet",
        3,
        Priority.BULK,
        500,
        "main",
        Degradation(level=3, static_reply=True),
        ReasonCode.DEGRADED_STATIC,
    ),
    ("pool:small", 3, Priority.BULK, 500, "main", Degradation(), ReasonCode.NONE),
]


@pytest.mark.parametrize(("scope", "level", "cls", "max_tokens", "pool", "want", "reason"), LADDER)
def test_degradation_ladder(
    scope: str,
    level: int,
    cls: Priority,
    max_tokens: int,
    pool: str,
    want: Degradation,
    reason: ReasonCode,
) -> None:
    req = request(max_tokens=max_tokens)
    got = policy().release(req, cls, accepted(cls=cls), control(degradation(scope, level)), NOW)
    assert isinstance(got, Admit)
    assert got.dispatch.pool == pool
    assert got.dispatch.degradation == want
    assert got.reason is reason
    assert got.dispatch.request == req
    assert got.dispatch.admitted_at == NOW


def test_the_pools_own_degradation_takes_precedence_over_the_fleets() -> None:
    ctl = control(degradation("fleet", 3), degradation("pool:main", 0))
    got = policy().release(request(), Priority.BULK, accepted(), ctl, NOW)
    assert isinstance(got, Admit)
    assert got.dispatch.degradation == Degradation()
    other = policy().release(request(pool="small"), Priority.BULK, accepted("small"), ctl, NOW)
    assert isinstance(other, Admit)
    assert other.dispatch.degradation.static_reply


def test_the_events_small_pool_and_cap_win_over_the_defaults() -> None:
    ctl = control(degradation("pool:main", 2, small_pool="vip", cap=10))
    got = policy().release(request(max_tokens=50), Priority.BULK, accepted(), ctl, NOW)
    assert isinstance(got, Admit)
    assert got.dispatch.pool == "vip"
    assert got.dispatch.degradation.max_tokens_cap == 10
    # a small pool admission does not know is no diversion at all
    unknown = control(degradation("pool:main", 1, small_pool="elsewhere"))
    kept = policy().release(request(), Priority.BULK, accepted(), unknown, NOW)
    assert isinstance(kept, Admit)
    assert kept.dispatch.pool == "main"
    assert kept.dispatch.degradation == Degradation()


def test_a_quota_degraded_request_says_so() -> None:
    got = policy().release(request(), Priority.BULK, accepted(degraded=True), control(), NOW)
    assert isinstance(got, Admit)
    assert got.dispatch.degradation == Degradation(quota_degraded=True)
    assert got.reason is ReasonCode.QUOTA_DEGRADED
    ctl = control(degradation("pool:main", 3))
    static = policy().release(request(), Priority.BULK, accepted(degraded=True), ctl, NOW)
    assert isinstance(static, Admit)
    assert static.dispatch.degradation == Degradation(
        level=3, static_reply=True, quota_degraded=True
    )
    assert static.reason is ReasonCode.DEGRADED_STATIC


@pytest.mark.parametrize(("level", "state", "probes", "refused"), BREAKER_CASES)
def test_breaker_levels_at_dispatch(
    level: BreakerLevel, state: Literal["closed", "open", "half_open"], probes: int, refused: bool
) -> None:
    ctl = control(breaker("pool:main", level, state, probes))
    got = policy().release(request(), Priority.STANDARD, accepted(), ctl, NOW)
    if refused:
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.BREAKER_OPEN)
    else:
        assert isinstance(got, Admit)


def test_half_open_lets_its_probes_through_per_decision_not_per_republication() -> None:
    p = policy()
    decision = breaker("pool:main", BreakerLevel.REJECT_NEW, "half_open", probes=2)
    ctl = control(decision)
    verdicts = [p.release(request(), Priority.BULK, accepted(), ctl, NOW) for _ in range(3)]
    assert [type(v).__name__ for v in verdicts] == ["Admit", "Admit", "Reply"]
    assert p.gate("main", ctl).probes_left == 0
    # The controller re-publishes the decision in force: new seq, same issued_at.
    for _ in range(3):
        assert ctl.apply(decision.model_copy(update={"seq": next(_seq)}))
        assert p.gate("main", ctl).refuse
    # A new half-open decision (the probes failed, the breaker re-opened, retried).
    later = breaker("pool:main", BreakerLevel.REJECT_NEW, "half_open", probes=1)
    ctl.apply(later.model_copy(update={"issued_at": NOW + 30}))
    assert p.gate("main", ctl).probes_left == 1
    assert isinstance(p.release(request(), Priority.BULK, accepted(), ctl, NOW), Admit)
    assert p.gate("main", ctl).refuse


@pytest.mark.parametrize(
    ("cancelled", "deadline", "expected"),
    [
        (True, None, (ReplyStatus.REJECTED, ReasonCode.CANCELLED)),
        (True, NOW - 1, (ReplyStatus.REJECTED, ReasonCode.CANCELLED)),
        (False, NOW - 1, (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED)),
    ],
)
def test_cancelled_or_expired_while_waiting(
    cancelled: bool, deadline: float | None, expected: tuple[ReplyStatus, ReasonCode]
) -> None:
    got = policy().release(
        request(deadline=deadline), Priority.BULK, accepted(), control(), NOW, cancelled
    )
    assert reply_of(got) == expected
    assert isinstance(got, Reply)
    assert got.reply.request_id == "r1"
    assert got.reply.completed_at == NOW


# -- properties ------------------------------------------------------------------------

scopes = st.sampled_from(["pool:main", "pool:small", "pool:vip", "fleet"])
events = st.lists(
    st.one_of(
        st.builds(
            lambda s, lv, pool, cap: degradation(s, lv, pool, cap),
            scopes,
            st.integers(0, 3),
            st.sampled_from([None, "small", "main", "nowhere"]),
            st.sampled_from([None, 1, 64, 4096]),
        ),
        st.builds(
            lambda s, lv, state, probes: breaker(s, lv, state, probes),
            scopes,
            st.sampled_from(list(BreakerLevel)),
            st.sampled_from(["closed", "open", "half_open"]),
            st.integers(0, 3),
        ),
        st.builds(throttle, st.sampled_from(["eu", "us"]), st.sampled_from([None, 0.0, 1.0, 50.0])),
        st.builds(
            lambda t, r: override(t, requests_per_s=r),
            st.sampled_from(["acme", "globex"]),
            st.sampled_from([None, 0.0, 3.0]),
        ),
    ),
    max_size=8,
)
requests_ = st.builds(
    request,
    tier=st.sampled_from(list(Tier)),
    pool=st.sampled_from(["main", "small", "vip", "nowhere"]),
    max_tokens=st.integers(1, 5000),
    region=st.sampled_from(["", "eu", "us"]),
    deadline=st.sampled_from([None, NOW - 1, NOW + 100]),
    tenant=st.sampled_from(["acme", "globex"]),
)


@given(requests_, st.sampled_from(list(Priority)), events, st.booleans())
def test_every_decision_is_consistent(
    req: InferenceRequest, cls: Priority, evs: list[ControlEvent], cancelled: bool
) -> None:
    p, ctl = policy(), control(*evs)
    screened = p.screen(req, cls, ctl, NOW)
    if isinstance(screened, Reply):
        r = screened.reply
        assert r.request_id == req.request_id
        assert r.status in (ReplyStatus.REJECTED, ReplyStatus.EXPIRED)
        assert (r.rate_limit is not None) == (r.status is ReplyStatus.REJECTED) or (
            r.reason is ReasonCode.INVALID_REQUEST
        )
        return
    assert screened.pool in CONFIG.pools
    dedicated = req.tier is Tier.ENTERPRISE and req.pool == "main"
    assert screened.pool == ("vip" if dedicated else req.pool)
    got = p.release(req, cls, Accepted(screened.pool, cls, False, 1.0), ctl, NOW, cancelled)
    if isinstance(got, Reply):
        assert got.reply.reason in (
            ReasonCode.CANCELLED,
            ReasonCode.BREAKER_OPEN,
            ReasonCode.DEADLINE_EXCEEDED,
        )
        assert not cancelled or got.reply.reason is ReasonCode.CANCELLED
        return
    assert not cancelled
    d = got.dispatch
    g = d.degradation
    assert d.pool in CONFIG.pools
    assert not p.gate(d.pool, ctl).refuse or p.gate(d.pool, ctl).probes_left is not None
    assert g.static_reply == (g.level == 3)
    if g.max_tokens_cap is not None:
        assert g.max_tokens_cap < req.sampling.max_tokens
        assert g.level == 2
    if g.diverted_from is not None:
        assert cls is not Priority.VIP
        assert d.pool != g.diverted_from == screened.pool
    else:
        assert d.pool == screened.pool
    assert (g.level == 0) == (got.reason in (ReasonCode.NONE, ReasonCode.QUOTA_DEGRADED))


@pytest.mark.parametrize(
    ("state", "level", "tripped", "share"),
    [
        ("closed", BreakerLevel.NONE, (), 1.0),
        ("half_open", BreakerLevel.RATE_LIMIT, (), 1.0),
        ("open", BreakerLevel.RATE_LIMIT, ("latency_p99_ms",), 0.5),
        ("open", BreakerLevel.LOG, ("error_rate",), 0.0),
        ("open", BreakerLevel.LOG, ("heartbeat",), 0.0),
        ("open", BreakerLevel.RATE_LIMIT, ("half_open_probe",), 0.0),
        ("open", BreakerLevel.RATE_LIMIT, ("latency_p99_ms", "error_rate"), 0.0),
        ("open", BreakerLevel.REJECT_NEW, ("cpu_percent",), 0.0),
        ("open", BreakerLevel.EMERGENCY, ("gpu_memory_percent",), 0.0),
    ],
)
def test_a_workers_breaker_isolates_it_or_leaves_it_a_share(
    state: Literal["closed", "open", "half_open"],
    level: BreakerLevel,
    tripped: tuple[str, ...],
    share: float,
) -> None:
    event = BreakerState(
        scope="worker:w1",
        state=state,
        level=level,
        tripped=tripped,
        seq=1,
        issued_at=0.0,
        evidence=Evidence(reason="test"),
    )
    assert worker_share(event, rate_limit_factor=0.5) == share


# -- the engine's context length ---------------------------------------------------------


@given(max_tokens=st.integers(1, 32_768), model_len=st.integers(16, 40_000))
def test_a_request_longer_than_the_pools_context_is_refused_before_any_charge(
    max_tokens: int, model_len: int
) -> None:
    req = request(max_tokens=max_tokens)  # "hello world": 2 prompt tokens
    got = policy().screen(req, Priority.STANDARD, control(), NOW, {"main": model_len})
    if 2 + max_tokens > model_len:
        assert reply_of(got) == (ReplyStatus.REJECTED, ReasonCode.INVALID_REQUEST)
        assert isinstance(got, Reply)
        assert got.reply.code == "context_length_exceeded"
        assert str(model_len) in got.reply.message
    else:
        assert isinstance(got, Screened)


def test_an_unknown_context_length_refuses_nothing() -> None:
    req = request(max_tokens=32_768)
    assert isinstance(policy().screen(req, Priority.STANDARD, control(), NOW), Screened)
    lens = {"small": 100}  # another pool's limit says nothing of main's
    assert isinstance(policy().screen(req, Priority.STANDARD, control(), NOW, lens), Screened)


def test_the_ladder_does_not_divert_what_the_small_pool_cannot_run() -> None:
    ctl = control(degradation("pool:main", 1))
    lens = {"main": 4096, "small": 1024}
    short, long = request(max_tokens=500), request(max_tokens=2000)
    short_got = policy().release(short, Priority.STANDARD, accepted(), ctl, NOW, model_lens=lens)
    long_got = policy().release(long, Priority.STANDARD, accepted(), ctl, NOW, model_lens=lens)
    assert isinstance(short_got, Admit)
    assert isinstance(long_got, Admit)
    assert (short_got.dispatch.pool, short_got.reason) == (
        "small",
        ReasonCode.DEGRADED_SMALL_MODEL,
    )
    assert (long_got.dispatch.pool, long_got.reason) == ("main", ReasonCode.NONE)
    assert long_got.dispatch.degradation.diverted_from is None


# -- canary split ----------------------------------------------------------------------


def split(share: float, target: str = "main.canary-v2") -> TrafficSplit:
    weights = {"main": 1.0 - share, target: share} if share < 1 else {target: 1.0}
    return TrafficSplit(**common("pool:main"), pool="main", weights=weights)


def with_session(session: str) -> InferenceRequest:
    return request().model_copy(update={"session_id": session, "request_id": f"r-{session}"})


def test_without_a_split_a_pool_keeps_its_traffic() -> None:
    assert policy().split("main", request(), control()) == "main"
    assert policy().pools(control()) == CONFIG.pools


def test_the_split_sends_the_canarys_share_and_names_its_pool() -> None:
    sessions = [with_session(f"s{i}") for i in range(2000)]
    state = control(split(0.25))
    sides = [policy().split("main", r, state) for r in sessions]
    assert set(sides) == {"main", "main.canary-v2"}
    assert 0.22 < sides.count("main.canary-v2") / len(sides) < 0.28
    assert policy().pools(state) == (*CONFIG.pools, "main.canary-v2")
    screened = policy().screen(
        sessions[sides.index("main.canary-v2")], Priority.STANDARD, state, NOW
    )
    assert isinstance(screened, Screened)
    assert screened.pool == "main.canary-v2"


@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=5), st.text(min_size=1, max_size=20))
def test_a_session_on_the_canary_stays_there_as_its_share_grows(
    shares: list[float], session: str
) -> None:
    req = with_session("".join(c for c in session if c.isalnum()) or "x")
    on_canary = False
    for share in sorted(shares):
        side = policy().split("main", req, control(split(share)))
        assert side in {"main", "main.canary-v2"}
        if on_canary:
            assert side == "main.canary-v2"
        on_canary = side == "main.canary-v2"
    assert policy().split("main", req, control(split(1.0))) == "main.canary-v2"


def test_a_split_never_sends_a_pool_s_traffic_to_another_pool() -> None:
    state = control(split(1.0, target="small"))
    assert policy().split("main", request(), state) == "main"
    assert policy().pools(state) == CONFIG.pools


# -- output consistency ----------------------------------------------------------------


def sampled_policy(share: float) -> AdmissionPolicy:
    return AdmissionPolicy(dataclasses.replace(CONFIG, consistency_sample=share))


def repeatable(n: int, temperature: float = 0.0, seed: int | None = None) -> InferenceRequest:
    sampling = SamplingParams(max_tokens=50, temperature=temperature, seed=seed)
    return request().model_copy(update={"request_id": f"r{n}", "sampling": sampling})


def released_shadow(p: AdmissionPolicy, req: InferenceRequest, state: ControlState) -> Any:
    verdict = p.release(req, Priority.STANDARD, accepted(), state, NOW)
    assert isinstance(verdict, Admit)
    return verdict.dispatch.shadow


def test_the_sampled_share_of_repeatable_requests_is_ordered_a_shadow() -> None:
    p, state = sampled_policy(0.1), control()
    orders = [released_shadow(p, repeatable(n), state) for n in range(3000)]
    sampled = [o for o in orders if o is not None]
    assert 0.08 < len(sampled) / len(orders) < 0.12
    assert {(o.pool, o.min_similarity) for o in sampled} == {
        ("main", CONFIG.consistency_min_similarity)
    }
    # the same request id is sampled alike every time (a redelivery, another replica)
    assert [released_shadow(p, repeatable(n), state) for n in range(3000)] == orders


def test_only_repeatable_requests_are_sampled() -> None:
    p, state = sampled_policy(1.0), control()
    assert released_shadow(p, repeatable(1, temperature=0.7), state) is None
    assert released_shadow(p, repeatable(1, temperature=0.7, seed=3), state) is not None
    assert released_shadow(sampled_policy(0.0), repeatable(1), state) is None


def test_no_shadow_for_a_degraded_pool_or_one_whose_breaker_is_not_closed() -> None:
    p = sampled_policy(1.0)
    assert released_shadow(p, repeatable(1), control(degradation("pool:main", 2))) is None
    probing = control(breaker("pool:main", BreakerLevel.REJECT_NEW, "half_open", probes=5))
    assert released_shadow(p, repeatable(1), probing) is None


def test_while_a_canary_runs_the_pools_shadows_go_to_the_canary() -> None:
    p = sampled_policy(1.0)
    order = released_shadow(p, repeatable(1), control(split(0.05)))
    assert order.pool == "main.canary-v2"
    verdict = p.release(
        repeatable(1), Priority.STANDARD, accepted("main.canary-v2"), control(split(0.05)), NOW
    )
    assert isinstance(verdict, Admit)
    assert verdict.dispatch.shadow is not None
    assert verdict.dispatch.shadow.pool == "main.canary-v2"
