"""The per-request decisions of admission (pure: no Kafka, no Redis; time is ``now``).

A request meets the policy three times:

1. ``screen`` when it is read: the checks that cost no quota. Past its deadline →
   ``expired``; an unknown pool → rejected; longer than the pool's workers can run
   (prompt + ``max_tokens`` above their ``max_model_len``, as their telemetry reports
   it) → rejected ``invalid_request`` / ``context_length_exceeded``; its destination
   pool's breaker refusing new work, its first token predicted after its deadline
   (``ttft``: rejected ``overloaded`` / ``deadline_unreachable``, ``Retry-After`` the
   predicted wait), its region blocked, or its tenant blocked by a quota override →
   rejected at once. Otherwise it yields the quota charges to make:
   the tenant's bucket (tier config, quota override applied; tokens reserved as prompt
   + ``max_tokens``) and, for a throttled region, the region's bucket (charged in the
   same atomic step: a refused tenant charges no region, and the reverse).
2. ``judge`` with the quota decisions: over quota → rejected with the rate-limit figures
   (strict tiers), or — for the tiers in ``scavenger_tiers`` — accepted into the
   *scavenger lane*, uncharged, keeping the refusal it was spared; otherwise accepted
   into its class's backlog. A pro request paid from its burst level is
   *quota-degraded*: admitted, but it waits, and is routed, as the class below its own
   (standard → bulk).
3. ``release`` when the scheduler picks it for dispatch, with the control state in force
   then: cancelled (the client's abort marker, checked at this last moment; status
   ``rejected``, reason ``cancelled``) or expired while waiting → terminal reply, and
   no GPU time; a breaker refusing → rejected; else the ``DispatchedRequest`` with its
   ``Degradation``.

Decision table (control state read per pool: the ``pool:<name>`` scope, else ``fleet``).

Tiers: basic — strict bucket, over quota → rejected (``quota_exceeded``); pro —
within baseline admitted, from the burst level admitted quota-degraded, beyond →
rejected; enterprise — its own bucket, dispatched to the dedicated pool of the pool it
asked for where there is one (``enterprise_pools``), else to that pool.

Work-conserving quotas (the scavenger lane): quotas protect the fleet and the other
tenants, not idle GPUs. An over-quota request of a scavenger tier waits in the lane of
its pool; a dispatch round serves it only from capacity left after every class's work
(``dispatching.pick``), and sheds it — the ``quota_exceeded`` reply with the rate-limit
figures of its refusal (``shed``) — as soon as other work waits for the pool, the pool is
paced or degraded, or ``scavenger_wait_s`` passes. Served, its reply says ``scavenged``
(HTTP 200, ``X-Seawall-Degraded: scavenged``); its tokens were never charged.
Redis unreachable (``quota.on_redis_down``): enterprise admitted, pro admitted
quota-degraded, basic rejected (``quota_unavailable``, ``Retry-After``).

Breaker (the destination pool's, when its state is not ``closed``): level 1 log — no
change (the service logs each change); level 2 rate limit — the pool is paced to
``rate_limit_factor`` of its batch slots; level 3 reject new and level 4 (emergency:
the pool's workers restart, the pool drains) — every request for the pool rejected
(``breaker_open``, ``Retry-After``); half-open at level 3+ lets ``probe_requests``
requests through per half-open *decision* (per admission instance), so that the
controller sees the probes it needs to close the circuit. A decision is told from its
re-publications by ``issued_at``, which re-publication keeps: re-publishing every few
seconds must not let another batch of probes through each time.

Degradation ladder (the requested pool's level; cumulative, as the controller issues
it): 1 — non-VIP classes are diverted to the small pool (``diverted_from``), unless
the request is longer than the small pool's workers can run; 2 — also,
long requests (``max_tokens`` above the cap; shorter ones are untouched) are capped
(``max_tokens_cap``); 3 — everyone gets the static reply (``static_reply``; no GPU time,
no diversion). ``Degradation.level`` is the highest rung applied to the request.

Region throttle (``RegionThrottle`` for ``request.client.region``): a shared bucket of
``rate_per_s`` requests per second, one second deep (at least one request); rate 0
blocks the region; over it → rejected (``region_throttled``). Quota override
(``QuotaOverride`` for the tenant, until ``expires_at``): ``requests_per_s`` and
``tokens_per_s`` replace the baseline rates, ``burst`` the depth of the requests
bucket; a 0 blocks the tenant.

Canary split (``TrafficSplit`` of the requested pool, while a canary release runs):
the pool's traffic is shared with its canary pool (``<pool>.canary-<version>``) by
weight, before anything else is decided, so the canary pool's own breaker, ladder and
capacity govern what it takes. A request's side follows a hash of its session (else
its request id): a session stays on one side, and as the canary's share grows the
sessions already on it stay there.

Output consistency (``consistency_sample``): a share of the repeatable requests sent
undegraded to a pool with its breaker closed carries a ``ShadowOrder``: once answered,
its worker has another worker re-run it and compare (``services.workers.shadows``).

Control events are trusted until replaced or until their ``valid_for_s`` runs out
(``services.common.control``): a controller that falls silent leaves its decisions in
force for at most that long, then every pool is back to the defaults above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar
from urllib.parse import quote

from schemas import (
    BreakerLevel,
    BreakerState,
    Degradation,
    DegradationLevel,
    DispatchedRequest,
    InferenceReply,
    InferenceRequest,
    Priority,
    QuotaOverride,
    RateLimitInfo,
    ReasonCode,
    RegionThrottle,
    ReplyStatus,
    ShadowOrder,
    Tier,
    TrafficSplit,
)
from seawall_client.topics import base_pool
from services.admission.bucket import Limit, QuotaDecision, TierConfig
from services.admission.cost import NO_COST, Cost
from services.admission.quota import QuotaRequest
from services.admission.ttft import PoolForecast, predict
from services.common.control import ControlState, isolates
from services.common.tokenizer import count_tokens

E = TypeVar("E", BreakerState, DegradationLevel)

#: Where a quota-degraded request waits: one class lower.
DEMOTED: Mapping[Priority, Priority] = {
    Priority.VIP: Priority.STANDARD,
    Priority.STANDARD: Priority.BULK,
    Priority.BULK: Priority.BULK,
}
_RUNG_REASONS: Mapping[int, ReasonCode] = {
    1: ReasonCode.DEGRADED_SMALL_MODEL,
    2: ReasonCode.DEGRADED_TRUNCATED,
    3: ReasonCode.DEGRADED_STATIC,
}
_WIRE_MAX_SECONDS = 86_400
NO_LIMITS: Mapping[str, int] = MappingProxyType({})
"""No pool's ``max_model_len`` known: nothing is refused for its length."""
NO_FORECASTS: Mapping[str, PoolForecast] = MappingProxyType({})
"""No TTFT prediction: nothing is refused for its deadline before it waits."""
_REGION_TOKENS = Limit(1.0, 1.0)
"""The region bucket's (unused) tokens dimension: region throttles count requests."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    tiers: Mapping[Tier, TierConfig]
    pools: tuple[str, ...] = ("main", "small")
    small_pool: str = "small"
    enterprise_pools: Mapping[str, str] = field(default_factory=dict)
    """A pool → the enterprise tier's dedicated pool serving the same model."""
    max_tokens_cap: int = 512
    rate_limit_factor: float = 0.5
    breaker_retry_after_s: float = 5.0
    quota_retry_after_s: float = 1.0
    scavenger_tiers: frozenset[Tier] = frozenset()
    """Tiers whose over-quota requests wait in the scavenger lane for idle capacity
    instead of being refused at once; the others are strict (the default: all)."""
    scavenger_wait_s: float = 2.0
    """How long an over-quota request may wait for idle capacity before it is refused."""
    scavenger_headroom: float = 0.2
    """The share of every budget the scavenger lane leaves free, for the work that may
    arrive before its requests finish (it cannot be taken back once dispatched)."""
    consistency_sample: float = 0.0
    """The share of repeatable requests ordered a shadow run (``shadow_order``)."""
    consistency_min_similarity: float = 0.5


@dataclass(frozen=True, slots=True)
class Reply:
    """A terminal reply instead of a dispatch."""

    reply: InferenceReply


@dataclass(frozen=True, slots=True)
class Screened:
    """Passed the free checks; these quota charges decide the rest."""

    pool: str
    """The pool asked for (the enterprise pool for the enterprise tier)."""
    tenant: QuotaRequest
    region: QuotaRequest | None = None
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Accepted:
    """Within quota; waits in ``cls``'s backlog for a dispatch slot."""

    pool: str
    cls: Priority
    quota_degraded: bool
    reserved_tokens: float
    """Tokens charged to the tenant's bucket, to correct at completion (0: none)."""
    cost: Cost = NO_COST
    """What it will occupy on a worker (the pacing rule's units)."""
    refusal: RateLimitInfo | None = None
    """Set for an over-quota request in the scavenger lane: the refusal it was spared,
    which it gets after all if no idle capacity comes in time (its 429 headers)."""

    @property
    def scavenger(self) -> bool:
        return self.refusal is not None


@dataclass(frozen=True, slots=True)
class Admit:
    dispatch: DispatchedRequest
    reason: ReasonCode
    """What admission changed (``none``: nothing)."""


@dataclass(frozen=True, slots=True)
class PoolGate:
    """What a pool's breaker lets through now."""

    refuse: bool = False
    factor: float = 1.0
    """The share of the pool's batch slots to fill."""
    level: BreakerLevel = BreakerLevel.NONE
    probes_left: int | None = None
    """Half-open: how many more requests may pass; ``None``: no such limit."""


def worker_share(breaker: BreakerState, rate_limit_factor: float) -> float:
    """The part of its batch slots a worker's own breaker leaves it: none when the state
    isolates it (``control.isolates``); ``rate_limit_factor`` when it is open for latency
    alone (level 2, rate limit) — the worker keeps serving, fewer at a time, so its P99
    can be seen to recover, where isolating it would leave its latency window empty and
    a small pool with no capacity at all; all of them otherwise (closed, half-open: the
    probes are ordinary requests)."""
    if isolates(breaker):
        return 0.0
    if breaker.state == "open" and breaker.level == BreakerLevel.RATE_LIMIT:
        return rate_limit_factor
    return 1.0


def engine_cost(cost: Cost, degradation: Degradation) -> Cost:
    """What a dispatched request occupies on its worker: nothing for a static reply, its
    ``max_tokens`` at most the truncation cap."""
    if degradation.static_reply:
        return NO_COST
    cap = degradation.max_tokens_cap
    return cost if cap is None else Cost(cost.prompt_tokens, min(cost.max_tokens, cap))


def prompt_tokens(request: InferenceRequest) -> int:
    """The prompt's size for the reservation (corrected from the worker's count later):
    ingress's count where it gave one (the priority topics are written by ingress)."""
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    if request.prompt is not None:
        return count_tokens(request.prompt)
    assert request.messages is not None
    return sum(count_tokens(m.content) for m in request.messages)


def region_bucket(region: str) -> str:
    """The quota-store name of a region's bucket (quoted: no braces, no collisions;
    region buckets have their own key namespace, ``RedisKeys.region_quota``)."""
    return quote(region, safe="")


def retry_only(seconds: float) -> RateLimitInfo:
    """Rate-limit fields of a rejection no quota figure applies to: only the retry hint."""
    s = min(float(max(1, math.ceil(seconds))), _WIRE_MAX_SECONDS)
    return RateLimitInfo(limit=0, remaining=0, reset_s=s, retry_after_s=s)


def terminal(
    request: InferenceRequest,
    status: ReplyStatus,
    reason: ReasonCode,
    message: str,
    now: float,
    rate_limit: RateLimitInfo | None = None,
    code: str | None = None,
) -> Reply:
    return Reply(
        InferenceReply(
            request_id=request.request_id,
            status=status,
            reason=reason,
            code=code,
            message=message,
            rate_limit=rate_limit,
            completed_at=now,
        )
    )


def failed(request: InferenceRequest, code: str, message: str, now: float) -> Reply:
    """The reply to a request whose processing failed on its own account (it cannot be
    dispatched: too large to forward, say); ``code`` and ``message`` never echo it."""
    return terminal(
        request, ReplyStatus.ERROR, ReasonCode.INVALID_REQUEST, message, now, None, code
    )


def sequence_tokens(request: InferenceRequest) -> int:
    """The longest sequence the request may need: its prompt plus ``max_tokens``."""
    return prompt_tokens(request) + request.sampling.max_tokens


def fits(sequence: int, pool: str, model_lens: Mapping[str, int]) -> bool:
    """Whether the pool's workers can run a sequence of ``sequence`` tokens (yes when
    their limit is unknown)."""
    limit = model_lens.get(pool)
    return limit is None or sequence <= limit


def sticky_point(key: str) -> float:
    """``key``'s place in [0, 1): the same on every replica and in every process."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest) / 2**64


def canaries_of(split: TrafficSplit) -> list[str]:
    """The canary pools ``split`` shares its pool's traffic with, in name order: only
    the pool's own canaries (any other target is ignored)."""
    return sorted(t for t in split.weights if t != split.pool and base_pool(t) == split.pool)


def _scoped(control: ControlState, kind: type[E], pool: str) -> E | None:
    """A pool's own decision, else the fleet-wide one."""
    return control.get(kind, f"pool:{pool}") or control.get(kind, "fleet")


def region_throttle(control: ControlState, region: str) -> RegionThrottle | None:
    """The throttle in force for a region (the latest issued, if several scopes name it)."""
    if not region:
        return None
    found = [t for t in control.all(RegionThrottle) if t.region == region]
    latest = max(found, key=lambda t: (t.issued_at, t.seq), default=None)
    return latest if latest is not None and latest.rate_per_s is not None else None


def quota_override(control: ControlState, tenant: str, now: float) -> QuotaOverride | None:
    found = [
        o
        for o in control.all(QuotaOverride)
        if o.tenant == tenant and (o.expires_at is None or now < o.expires_at)
    ]
    return max(found, key=lambda o: (o.issued_at, o.seq), default=None)


def override_terms(override: QuotaOverride) -> tuple[float | None, ...]:
    """What of an override shapes a tenant's bucket (its re-publications change none of
    it)."""
    return (override.requests_per_s, override.tokens_per_s, override.burst, override.expires_at)


def overridden(base: TierConfig, override: QuotaOverride | None) -> TierConfig | None:
    """The tenant's effective bucket config; ``None`` when the override blocks it."""
    if override is None:
        return base
    values = (override.requests_per_s, override.tokens_per_s, override.burst)
    if any(v == 0 for v in values):
        return None
    requests = dataclasses.replace(
        base.requests,
        rate=override.requests_per_s or base.requests.rate,
        capacity=override.burst or base.requests.capacity,
    )
    tokens = dataclasses.replace(base.tokens, rate=override.tokens_per_s or base.tokens.rate)
    return TierConfig(base.tier, requests, tokens)


class AdmissionPolicy:
    """The three decisions, plus the half-open probe budget (the only state kept)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._probes_used: dict[str, tuple[float, int]] = {}
        """Breaker control key → (``issued_at`` of the half-open decision, probes let
        through under it)."""

    # -- routing -------------------------------------------------------------------
    def requested_pool(self, request: InferenceRequest) -> str:
        if request.tier is Tier.ENTERPRISE:
            return self.config.enterprise_pools.get(request.pool, request.pool)
        return request.pool

    def split(self, pool: str, request: InferenceRequest, control: ControlState) -> str:
        """The pool or canary pool that takes this request (see "Canary split")."""
        event = control.get(TrafficSplit, f"pool:{pool}")
        if event is None:
            return pool
        point = sticky_point(f"{pool}/{request.dispatch_key}")
        share = 0.0
        for target in canaries_of(event):
            share += event.weights[target]
            if point < share:
                return target
        return pool

    def pools(self, control: ControlState) -> tuple[str, ...]:
        """The configured pools and the canary pools their splits send work to now."""
        canaries = {
            target
            for event in control.all(TrafficSplit)
            for target in canaries_of(event)
            if target not in self.config.pools
        }
        return (*self.config.pools, *sorted(canaries))

    def destination(self, pool: str, cls: Priority, control: ControlState) -> str:
        """Where the work of class ``cls`` for ``pool`` goes now (level 1 diverts)."""
        event = _scoped(control, DegradationLevel, pool)
        if event is None or event.level not in (1, 2) or cls is Priority.VIP:
            return pool
        target = event.small_pool or self.config.small_pool
        return target if target in self.config.pools else pool

    def route(
        self,
        pool: str,
        cls: Priority,
        request: InferenceRequest,
        control: ControlState,
        model_lens: Mapping[str, int] = NO_LIMITS,
    ) -> tuple[str, int, Degradation]:
        """Destination pool, rung applied and degradation for a request of ``pool``."""
        event = _scoped(control, DegradationLevel, pool)
        if event is None or event.level == 0:
            return pool, 0, Degradation()
        if event.level >= 3:
            return pool, 3, Degradation(level=3, static_reply=True)
        dest = self.destination(pool, cls, control)
        if not fits(sequence_tokens(request), dest, model_lens):
            dest = pool  # the small pool cannot run it: it stays where it was asked
        rung = 1 if dest != pool else 0
        cap: int | None = None
        limit = event.max_tokens_cap or self.config.max_tokens_cap
        if event.level >= 2 and request.sampling.max_tokens > limit:
            rung, cap = 2, limit
        diverted_from = pool if dest != pool else None
        return dest, rung, Degradation(level=rung, diverted_from=diverted_from, max_tokens_cap=cap)

    def gate(self, pool: str, control: ControlState) -> PoolGate:
        breaker = _scoped(control, BreakerState, pool)
        if breaker is None or breaker.state == "closed":
            return PoolGate()
        level = breaker.level
        if level >= BreakerLevel.REJECT_NEW:
            if breaker.state == "open":
                return PoolGate(refuse=True, level=level)
            issued, used = self._probes_used.get(breaker.control_key, (breaker.issued_at, 0))
            left = breaker.probe_requests - (used if issued == breaker.issued_at else 0)
            return PoolGate(refuse=left <= 0, level=level, probes_left=max(0, left))
        factor = self.config.rate_limit_factor if level == BreakerLevel.RATE_LIMIT else 1.0
        return PoolGate(factor=factor, level=level)

    def _spend_probe(self, pool: str, control: ControlState) -> None:
        breaker = _scoped(control, BreakerState, pool)
        assert breaker is not None
        issued, used = self._probes_used.get(breaker.control_key, (breaker.issued_at, 0))
        used = used + 1 if issued == breaker.issued_at else 1
        self._probes_used[breaker.control_key] = (breaker.issued_at, used)

    def tenant_config(
        self, tenant: str, tier: Tier, control: ControlState, now: float
    ) -> TierConfig | None:
        """The tenant's bucket config with its quota override; ``None``: blocked."""
        return overridden(self.config.tiers[tier], quota_override(control, tenant, now))

    # -- 1. on reading ---------------------------------------------------------------
    def screen(
        self,
        request: InferenceRequest,
        cls: Priority,
        control: ControlState,
        now: float,
        model_lens: Mapping[str, int] = NO_LIMITS,
        forecasts: Mapping[str, PoolForecast] = NO_FORECASTS,
    ) -> Reply | Screened:
        """``model_lens``: each pool's ``max_model_len``, where its workers reported it;
        ``forecasts``: what each pool's TTFT prediction reads (``ttft``)."""
        early = self._terminal(request, now, cancelled=False)
        if early is not None:
            return early
        pool = self.requested_pool(request)
        if pool not in self.config.pools:
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.INVALID_REQUEST,
                f"no such pool {pool!r}",
                now,
                code="model_not_found",
            )
        pool = self.split(pool, request, control)
        prompt = prompt_tokens(request)  # once: counting was a tenth of admission's work
        sequence = prompt + request.sampling.max_tokens
        if not fits(sequence, pool, model_lens):
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.INVALID_REQUEST,
                f"This model's maximum context length is {model_lens[pool]} tokens; the "
                f"request needs {sequence} (prompt plus max_tokens).",
                now,
                code="context_length_exceeded",
            )
        dest = self.destination(pool, cls, control)
        if self.gate(dest, control).refuse:
            return self._breaker_open(request, dest, now)
        forecast = forecasts.get(dest)
        wait_s = None if forecast is None else predict(prompt, cls, forecast)
        if (
            wait_s is not None
            and request.deadline_at is not None
            and now + wait_s > request.deadline_at
        ):
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.OVERLOADED,
                f"the first token would come in about {wait_s:.1f} s, after the deadline",
                now,
                retry_only(wait_s),
                code="deadline_unreachable",
            )
        region: QuotaRequest | None = None
        throttle = region_throttle(control, request.client.region)
        if throttle is not None:
            rate = throttle.rate_per_s
            assert rate is not None
            if rate == 0:
                return terminal(
                    request,
                    ReplyStatus.REJECTED,
                    ReasonCode.REGION_THROTTLED,
                    "requests from this region are suspended",
                    now,
                    retry_only(self.config.quota_retry_after_s),
                )
            region_config = TierConfig(Tier.BASIC, Limit(max(1.0, rate), rate), _REGION_TOKENS)
            region = QuotaRequest(region_bucket(request.client.region), region_config, 1, 0)
        config = self.tenant_config(request.tenant, request.tier, control, now)
        if config is None:
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.QUOTA_EXCEEDED,
                "the tenant's quota is suspended",
                now,
                retry_only(self.config.quota_retry_after_s),
            )
        tokens = prompt + request.sampling.max_tokens
        return Screened(pool, QuotaRequest(request.tenant, config, 1, tokens), region, prompt)

    # -- 2. with the quota decisions ----------------------------------------------------
    def judge(
        self,
        request: InferenceRequest,
        cls: Priority,
        screened: Screened,
        now: float,
        tenant: QuotaDecision,
        region: QuotaDecision | None = None,
    ) -> Reply | Accepted:
        """``region`` is ``None`` when there was no region bucket to charge (or the
        quota store was down). A refused region's tenant was not charged, and the
        reverse (one atomic charge)."""
        if region is not None and not region.allowed:
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.REGION_THROTTLED,
                "too many requests from this region",
                now,
                region.rate_limit_info() or retry_only(region.retry_after_s),
            )
        over_quota = tenant.reason not in ("quota_unavailable", "cost_exceeds_capacity")
        if not tenant.allowed and over_quota and request.tier in self.config.scavenger_tiers:
            return Accepted(
                screened.pool,
                Priority.BULK,
                False,
                0.0,  # nothing was charged: the bucket refused it
                Cost(screened.prompt_tokens, request.sampling.max_tokens),
                tenant.rate_limit_info() or retry_only(tenant.retry_after_s),
            )
        if not tenant.allowed:
            if tenant.reason == "quota_unavailable":
                reason, message = ReasonCode.QUOTA_UNAVAILABLE, "quota store unavailable"
            elif tenant.reason == "cost_exceeds_capacity":
                reason, message = ReasonCode.QUOTA_EXCEEDED, "the request exceeds the quota"
            else:
                reason, message = ReasonCode.QUOTA_EXCEEDED, "quota exceeded"
            return terminal(
                request,
                ReplyStatus.REJECTED,
                reason,
                message,
                now,
                tenant.rate_limit_info() or retry_only(tenant.retry_after_s),
            )
        degraded = tenant.outcome == "degrade"
        reserved = 0.0 if tenant.reason == "quota_unavailable" else screened.tenant.tokens
        cost = Cost(screened.prompt_tokens, request.sampling.max_tokens)
        return Accepted(screened.pool, DEMOTED[cls] if degraded else cls, degraded, reserved, cost)

    # -- 3. at dispatch ---------------------------------------------------------------
    def release(
        self,
        request: InferenceRequest,
        cls: Priority,
        accepted: Accepted,
        control: ControlState,
        now: float,
        cancelled: bool = False,
        model_lens: Mapping[str, int] = NO_LIMITS,
    ) -> Reply | Admit:
        early = self._terminal(request, now, cancelled)
        if early is not None:
            return early
        dest, rung, degradation = self.route(accepted.pool, cls, request, control, model_lens)
        gate = self.gate(dest, control)
        if gate.refuse:
            return self._breaker_open(request, dest, now)
        if gate.probes_left is not None:
            self._spend_probe(dest, control)
        if accepted.quota_degraded:
            degradation = degradation.model_copy(update={"quota_degraded": True})
        if accepted.scavenger:
            degradation = degradation.model_copy(update={"scavenged": True})
        if rung:
            reason = _RUNG_REASONS[rung]
        elif accepted.scavenger:
            reason = ReasonCode.SCAVENGED
        else:
            reason = ReasonCode.QUOTA_DEGRADED if accepted.quota_degraded else ReasonCode.NONE
        shadow = None
        if reason is ReasonCode.NONE and gate == PoolGate():
            shadow = self.shadow_order(request, dest, control)
        dispatch = DispatchedRequest(
            request=request, pool=dest, degradation=degradation, admitted_at=now, shadow=shadow
        )
        return Admit(dispatch, reason)

    def shadow_order(
        self, request: InferenceRequest, pool: str, control: ControlState
    ) -> ShadowOrder | None:
        """Whether ``request``, sent to ``pool`` undegraded, is sampled for the output-
        consistency check, and where its shadow runs: on its own pool, or — while a
        canary of the pool takes traffic — on the canary, which is then held to the
        baseline's outputs. Sampled by a hash of the request id: every replica, and a
        redelivery, decides alike."""
        sampling = request.sampling
        if sampling.temperature != 0 and sampling.seed is None:
            return None  # nothing to compare: two runs may rightly differ
        if sticky_point(f"shadow/{request.request_id}") >= self.config.consistency_sample:
            return None
        split = control.get(TrafficSplit, f"pool:{pool}")
        taking = [t for t in canaries_of(split) if split.weights[t] > 0] if split else []
        target = taking[0] if taking else pool
        return ShadowOrder(pool=target, min_similarity=self.config.consistency_min_similarity)

    def shed(self, request: InferenceRequest, accepted: Accepted, now: float) -> Reply:
        """An over-quota request no idle capacity came for (or the pool tightened): the
        quota refusal it was spared, with the rate-limit figures of that moment."""
        return terminal(
            request,
            ReplyStatus.REJECTED,
            ReasonCode.QUOTA_EXCEEDED,
            "quota exceeded, and no idle capacity to serve it beyond the quota",
            now,
            accepted.refusal or retry_only(self.config.quota_retry_after_s),
        )

    # -- shared ---------------------------------------------------------------------
    @staticmethod
    def _terminal(request: InferenceRequest, now: float, cancelled: bool) -> Reply | None:
        if cancelled:
            return terminal(
                request,
                ReplyStatus.REJECTED,
                ReasonCode.CANCELLED,
                "cancelled by the client before dispatch",
                now,
            )
        if request.expired(now):
            return terminal(
                request,
                ReplyStatus.EXPIRED,
                ReasonCode.DEADLINE_EXCEEDED,
                "the deadline passed before dispatch",
                now,
            )
        return None

    def _breaker_open(self, request: InferenceRequest, pool: str, now: float) -> Reply:
        return terminal(
            request,
            ReplyStatus.REJECTED,
            ReasonCode.BREAKER_OPEN,
            f"pool {pool!r} is not taking new requests",
            now,
            retry_only(self.config.breaker_retry_after_s),
        )
