"""The pure token-bucket model behind admission quotas (DESIGN, "Tiers and priority").

No Redis, no clock: time comes in as ``now`` (seconds). ``bucket.lua`` (beside the
``quota`` shell, which loads it) is the same model run atomically inside Redis on the
server's clock; the two are kept in lock-step by the integration tests, which replay the
script's decisions through this module and demand bit-identical states. Any change here
must be made there too, operation for operation: both sides do the same IEEE-754 double
arithmetic in the same order.

Model. A bucket has a *baseline* level (``capacity``, refilled at ``rate`` per second)
and an optional *burst* level (``burst_capacity``, refilled at ``burst_rate``), sharing
one timestamp. A cost is paid from the baseline when it covers it; otherwise the
baseline is emptied and the rest comes from the burst level, and the request is
*degraded*; when both together cannot pay, it is rejected and nothing is spent.
Quotas count two dimensions, requests and tokens, decided together: a request is
admitted only when every dimension can pay, and then every dimension pays.

Fixes to seed 2's bucket: the levels and the timestamp live in one record (one hash in
Redis), a missing record starts full *with* a timestamp, time has sub-second precision,
a clock that steps backwards refills nothing (and does not move the timestamp back),
and every write carries a TTL of at least the time to refill completely, so an expired
key is indistinguishable from a full one.

Tiers: basic is a strict bucket (no burst level; over quota → rejected), pro has a burst
level (above baseline → degraded, beyond burst → rejected), enterprise has its own
dedicated bucket sized by contract. Every tenant's buckets are its own keys, so no
tenant's spending touches another's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from schemas import RateLimitInfo, Tier

Dimension = Literal["requests", "tokens"]
DIMENSIONS: tuple[Dimension, ...] = ("requests", "tokens")

Outcome = Literal["admit", "degrade", "reject"]
Reason = Literal["ok", "burst", "quota_exhausted", "cost_exceeds_capacity", "quota_unavailable"]
"""``ok``: admitted within baseline; ``burst``: admitted degraded from the burst level;
``quota_exhausted``: rejected, retry after ``retry_after_s``; ``cost_exceeds_capacity``:
rejected, and it can never be admitted (no ``Retry-After``); ``quota_unavailable``: the
quota store was down and the tier's fallback decided (see ``quota.on_redis_down``)."""

DEFAULT_TTL_MARGIN_MS = 1_000
_WIRE_MAX_COUNT = 2**31
_WIRE_MAX_SECONDS = 86_400


@dataclass(frozen=True, slots=True)
class Limit:
    """One dimension's bucket: baseline and optional burst level, rates per second."""

    capacity: float
    rate: float
    burst_capacity: float = 0.0
    burst_rate: float = 0.0

    def __post_init__(self) -> None:
        values = (self.capacity, self.rate, self.burst_capacity, self.burst_rate)
        if not all(math.isfinite(v) for v in values):
            raise ValueError("bucket limits must be finite")
        if self.capacity <= 0 or self.rate <= 0:
            # A zero rate would never refill, so its key could never expire safely.
            raise ValueError("capacity and rate must be positive")
        if self.burst_capacity < 0 or self.burst_rate < 0:
            raise ValueError("burst capacity and rate must not be negative")
        if (self.burst_capacity > 0) != (self.burst_rate > 0):
            raise ValueError("a burst level needs both a capacity and a refill rate")

    @property
    def total(self) -> float:
        return self.capacity + self.burst_capacity


@dataclass(frozen=True, slots=True)
class BucketState:
    """The one record per bucket: baseline level, timestamp, burst level."""

    tokens: float
    ts: float
    burst: float = 0.0


@dataclass(frozen=True, slots=True)
class Take:
    """One bucket after a decision, with the figures for the ``X-RateLimit-*`` headers."""

    state: BucketState
    limit: float
    """Baseline plus burst capacity."""
    remaining: int
    """Whole units left in both levels."""
    reset_after_s: float
    """Seconds until both levels are full again."""
    retry_after_s: float
    """0 when this bucket could pay the cost now; ``inf`` when it never can."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    tier: Tier
    requests: Limit
    tokens: Limit

    def __post_init__(self) -> None:
        if self.tier is Tier.BASIC and (self.requests.burst_capacity or self.tokens.burst_capacity):
            raise ValueError("the basic tier is a strict bucket: it has no burst level")

    def limit(self, dimension: Dimension) -> Limit:
        return self.requests if dimension == "requests" else self.tokens


DEFAULT_TIERS: Mapping[Tier, TierConfig] = {
    Tier.BASIC: TierConfig(Tier.BASIC, Limit(20, 1.0), Limit(40_000, 2_000)),
    Tier.PRO: TierConfig(
        Tier.PRO,
        Limit(100, 5.0, burst_capacity=100, burst_rate=5.0),
        Limit(200_000, 10_000, burst_capacity=200_000, burst_rate=10_000),
    ),
    Tier.ENTERPRISE: TierConfig(Tier.ENTERPRISE, Limit(500, 50.0), Limit(1_000_000, 50_000)),
}
"""Defaults for a small fleet; operators size them per tenant."""


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    outcome: Outcome
    reason: Reason
    dimensions: Mapping[Dimension, Take] = field(default_factory=dict)
    retry_after_s: float = 0.0
    at: float | None = None
    """The clock reading the decision used (the Redis server's clock for ``RedisQuota``)."""

    @property
    def allowed(self) -> bool:
        return self.outcome != "reject"

    @property
    def binding(self) -> Take | None:
        """The dimension the headers report: on a rejection the one to wait longest for,
        otherwise the one closest to empty."""
        takes = self.dimensions.values()
        if not takes:
            return None
        if self.outcome == "reject":
            return max(takes, key=lambda t: t.retry_after_s)
        return min(takes, key=lambda t: t.remaining / t.limit)

    @property
    def retry_after_header_s(self) -> int | None:
        """Whole seconds for ``Retry-After``: only on a rejection a retry can cure."""
        if self.outcome != "reject" or not math.isfinite(self.retry_after_s):
            return None
        return max(1, math.ceil(self.retry_after_s))

    def rate_limit_info(self) -> RateLimitInfo | None:
        """The binding dimension's figures, as carried on a reply (clamped to the wire's
        bounds)."""
        b = self.binding
        if b is None:
            return None
        return RateLimitInfo(
            limit=min(math.floor(b.limit), _WIRE_MAX_COUNT),
            remaining=min(b.remaining, _WIRE_MAX_COUNT),
            reset_s=min(math.ceil(b.reset_after_s), _WIRE_MAX_SECONDS),
            retry_after_s=min(self.retry_after_header_s or 0, _WIRE_MAX_SECONDS),
        )

    def headers(self) -> dict[str, str]:
        """``X-RateLimit-Limit/Remaining/Reset`` (reset in delta seconds) and
        ``Retry-After``."""
        out: dict[str, str] = {}
        info = self.rate_limit_info()
        if info is not None:
            out["X-RateLimit-Limit"] = str(info.limit)
            out["X-RateLimit-Remaining"] = str(info.remaining)
            out["X-RateLimit-Reset"] = str(math.ceil(info.reset_s))
        retry = self.retry_after_header_s
        if retry is not None:
            out["Retry-After"] = str(retry)
        return out


def redis_clock(seconds: int, microseconds: int) -> float:
    """The ``now`` that ``bucket.lua`` computes from Redis ``TIME``, bit for bit."""
    return seconds + microseconds / 1_000_000


def check_cost(cost: float) -> None:
    if cost < 0 or not math.isfinite(cost):
        raise ValueError("a cost must be finite and not negative")


def check_delta(delta: float) -> None:
    if not math.isfinite(delta):
        raise ValueError("a correction must be finite")


def refill(state: BucketState | None, now: float, limit: Limit) -> BucketState:
    if state is None:
        return BucketState(limit.capacity, now, limit.burst_capacity)
    elapsed = max(0.0, now - state.ts)
    return BucketState(
        min(limit.capacity, state.tokens + elapsed * limit.rate),
        max(state.ts, now),
        min(limit.burst_capacity, state.burst + elapsed * limit.burst_rate),
    )


def _fits(state: BucketState, cost: float) -> Outcome:
    if cost <= state.tokens:
        return "admit"
    if cost <= state.tokens + state.burst:
        return "degrade"
    return "reject"


def _spend(state: BucketState, cost: float) -> BucketState:
    if cost <= state.tokens:
        return BucketState(state.tokens - cost, state.ts, state.burst)
    return BucketState(0.0, state.ts, state.burst - (cost - state.tokens))


def time_until_full(state: BucketState, limit: Limit) -> float:
    full_after = (limit.capacity - state.tokens) / limit.rate
    if limit.burst_capacity > 0:
        full_after = max(full_after, (limit.burst_capacity - state.burst) / limit.burst_rate)
    return full_after


def ttl_ms(state: BucketState, limit: Limit, margin_ms: int = DEFAULT_TTL_MARGIN_MS) -> int:
    """The key's TTL after a write: once it expires the bucket would have been full."""
    return math.ceil(time_until_full(state, limit) * 1000) + margin_ms


def time_until_available(state: BucketState, cost: float, limit: Limit) -> float:
    """Seconds until baseline plus burst can pay ``cost``; ``inf`` if they never can.

    Both levels refill linearly until each saturates, so the available amount is
    piecewise linear; walk its breakpoints.
    """
    if cost > limit.total:
        return math.inf
    available = state.tokens + state.burst
    if cost <= available:
        return 0.0
    levels = [((limit.capacity - state.tokens) / limit.rate, limit.rate)]
    if limit.burst_capacity > 0:
        levels.append(((limit.burst_capacity - state.burst) / limit.burst_rate, limit.burst_rate))
    levels.sort()
    t = 0.0
    slope = sum(rate for _, rate in levels)
    for saturates_at, rate in levels:
        reach = available + slope * (saturates_at - t)
        if reach >= cost:
            return t + (cost - available) / slope
        available, t, slope = reach, saturates_at, slope - rate
    return t  # rounding only: once both levels are full, limit.total >= cost is available


def assess(state: BucketState, cost: float, limit: Limit, allowed: bool) -> Take:
    """The header figures of a bucket left in ``state`` by a decision.

    On a rejection ``state`` is the refilled, unspent state, from which the wait for
    ``cost`` is measured.
    """
    return Take(
        state=state,
        limit=limit.total,
        remaining=max(0, math.floor(state.tokens + state.burst)),
        reset_after_s=time_until_full(state, limit),
        retry_after_s=0.0 if allowed else time_until_available(state, cost, limit),
    )


Group = tuple[Sequence[BucketState | None], Sequence[float], Sequence[Limit]]
"""Buckets decided as one: their states, costs and limits (parallel)."""


def charge(groups: Sequence[Group], now: float) -> list[tuple[Outcome, tuple[Take, ...]]]:
    """Decide groups of buckets as one charge (a region's and a tenant's): each group
    gets its own outcome — ``degrade`` when any of its buckets had to draw on its burst
    level — and if any group rejects, nothing is spent in any group.

    The returned states are to be stored whatever the outcome (a rejection stores the
    refilled state), exactly as the Lua script does.
    """
    refilled: list[list[BucketState]] = []
    outcomes: list[Outcome] = []
    for states, costs, limits in groups:
        if not len(states) == len(costs) == len(limits):
            raise ValueError("states, costs and limits must be parallel")
        for c in costs:
            check_cost(c)
        group = [refill(s, now, lim) for s, lim in zip(states, limits, strict=True)]
        fits = [_fits(s, c) for s, c in zip(group, costs, strict=True)]
        outcome: Outcome = (
            "reject" if "reject" in fits else "degrade" if "degrade" in fits else "admit"
        )
        refilled.append(group)
        outcomes.append(outcome)
    spend = "reject" not in outcomes
    results = []
    for (_, costs, limits), group, outcome in zip(groups, refilled, outcomes, strict=True):
        after = [_spend(s, c) for s, c in zip(group, costs, strict=True)] if spend else group
        allowed = outcome != "reject"
        takes = tuple(
            assess(s, c, lim, allowed) for s, c, lim in zip(after, costs, limits, strict=True)
        )
        results.append((outcome, takes))
    return results


def take_together(
    states: Sequence[BucketState | None],
    costs: Sequence[float],
    now: float,
    limits: Sequence[Limit],
) -> tuple[Outcome, tuple[Take, ...]]:
    """Decide several buckets as one: all pay, or none does (``charge`` of one group)."""
    ((outcome, takes),) = charge([(states, costs, limits)], now)
    return outcome, takes


def take(state: BucketState | None, cost: float, now: float, limit: Limit) -> tuple[Outcome, Take]:
    """Decide one bucket."""
    outcome, (result,) = take_together((state,), (cost,), now, (limit,))
    return outcome, result


def adjust(state: BucketState | None, delta: float, now: float, limit: Limit) -> BucketState:
    """Correct a reservation once the real cost is known.

    Admission reserves ``prompt + max_tokens`` tokens; at completion the worker reports
    the actual count and ``delta = actual - reserved`` is applied: a refund (delta < 0)
    fills the baseline first, overflowing into the burst level, each capped at its
    capacity; a charge (delta > 0) drains the baseline then the burst level and stops at
    empty (levels never go negative, so an under-reservation is forgiven beyond that).
    """
    check_delta(delta)
    s = refill(state, now, limit)
    if delta <= 0:
        credit = -delta
        room = limit.capacity - s.tokens
        if credit <= room:
            return BucketState(s.tokens + credit, s.ts, s.burst)
        burst = min(limit.burst_capacity, s.burst + (credit - room))
        return BucketState(limit.capacity, s.ts, burst)
    if delta <= s.tokens:
        return BucketState(s.tokens - delta, s.ts, s.burst)
    return BucketState(0.0, s.ts, max(0.0, s.burst - (delta - s.tokens)))


def make_decision(
    outcome: Outcome,
    takes: Mapping[Dimension, Take],
    costs: Mapping[Dimension, float],
    limits: Mapping[Dimension, Limit],
    at: float | None = None,
) -> QuotaDecision:
    """Wrap a multi-dimension outcome into a decision with its reason code."""
    if outcome == "reject":
        never = any(costs[d] > limits[d].total for d in takes)
        reason: Reason = "cost_exceeds_capacity" if never else "quota_exhausted"
        retry = max(t.retry_after_s for t in takes.values())
    else:
        reason = "burst" if outcome == "degrade" else "ok"
        retry = 0.0
    return QuotaDecision(outcome, reason, dict(takes), retry, at)


def decide(
    config: TierConfig,
    states: Mapping[Dimension, BucketState | None],
    now: float,
    requests: float = 1,
    tokens: float = 0,
) -> tuple[QuotaDecision, dict[Dimension, BucketState]]:
    """One admission decision for a tenant: the decision and the states to store."""
    costs: dict[Dimension, float] = {"requests": requests, "tokens": tokens}
    limits = {d: config.limit(d) for d in DIMENSIONS}
    outcome, takes = take_together(
        [states.get(d) for d in DIMENSIONS],
        [costs[d] for d in DIMENSIONS],
        now,
        [limits[d] for d in DIMENSIONS],
    )
    by_dim = dict(zip(DIMENSIONS, takes, strict=True))
    decision = make_decision(outcome, by_dim, costs, limits, now)
    return decision, {d: t.state for d, t in by_dim.items()}
