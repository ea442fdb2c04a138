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
The breaker, degradation ladder and canary split are described in ``routing``; region
throttles and quota overrides in ``overrides``.

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

Output consistency (``consistency_sample``): a share of the repeatable requests sent
undegraded to a pool with its breaker closed carries a ``ShadowOrder``: once answered,
its worker has another worker re-run it and compare (``services.workers.shadows``).

Control events are trusted until replaced or until their ``valid_for_s`` runs out
(``services.common.control_state``): a controller that falls silent leaves its decisions in
force for at most that long, then every pool is back to the defaults above.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from schemas import (
    DispatchedRequest,
    InferenceRequest,
    Priority,
    ReasonCode,
    ReplyStatus,
    ShadowOrder,
    Tier,
    TrafficSplit,
)
from services.admission.policy.bucket import Limit, QuotaDecision, TierConfig
from services.admission.policy.charges import QuotaRequest
from services.admission.policy.cost import Cost
from services.admission.policy.outcomes import (
    Accepted,
    Admit,
    Reply,
    Screened,
    retry_only,
    terminal,
)
from services.admission.policy.overrides import (
    overridden,
    quota_override,
    region_bucket,
    region_throttle,
)
from services.admission.policy.routing import (
    OPEN_GATE,
    PoolRouting,
    canaries_of,
    sticky_point,
)
from services.admission.policy.sizing import NO_LIMITS, fits, prompt_tokens
from services.admission.policy.ttft import PoolForecast, predict
from services.common.control_state import ControlState

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
NO_FORECASTS: Mapping[str, PoolForecast] = MappingProxyType({})
"""No TTFT prediction: nothing is refused for its deadline before it waits."""
_REGION_TOKENS = Limit(1.0, 1.0)
"""The region bucket's (unused) tokens dimension: region throttles count requests."""


class AdmissionPolicy(PoolRouting):
    """The three decisions (the half-open probe budget, the only state kept, is
    ``PoolRouting``'s)."""

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
        if reason is ReasonCode.NONE and gate == OPEN_GATE:
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
        baseline's outputs. Sampled by a keyed hash of the request id (the fleet's
        sampling secret): every replica, and a redelivery, decides alike, and a producer
        choosing its ids cannot tell which are sampled."""
        sampling = request.sampling
        if sampling.temperature != 0 and sampling.seed is None:
            return None  # nothing to compare: two runs may rightly differ
        point = sticky_point(self.config.sampling_secret, f"shadow/{request.request_id}")
        if point >= self.config.consistency_sample:
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
