"""Admission settings (``SEAWALL_`` environment variables).

Tier quotas default to ``bucket.DEFAULT_TIERS``; any part of them may be overridden,
either leaf by leaf (``SEAWALL_QUOTA_BASIC__REQUESTS__CAPACITY=5``) or as JSON
(``SEAWALL_QUOTA_PRO='{"tokens": {"rate": 20000}}'``); what is not given keeps its
default.

Pools. ``small_pool`` is where degradation level 1 diverts non-VIP work when the
controller's event names no pool; it must be among ``pools``. ``enterprise_pools`` maps
a pool to the enterprise tier's dedicated pool serving the same model
(``SEAWALL_ENTERPRISE_POOLS='{"main": "main-dedicated"}'``): an enterprise request for
``main`` goes there, one for a pool without a dedicated one stays where its model is
served (an enterprise tenant never gets another model than it asked for). Empty by
default: the default fleet has no dedicated pool (the enterprise tier still has its
own quota bucket and the VIP class's floor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from schemas import Tier
from services.admission.policy.bucket import DEFAULT_TIERS, Limit, TierConfig
from services.common.settings import CommonSettings


class LimitSettings(BaseModel):
    """One dimension's bucket (see ``bucket.Limit``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    capacity: float = Field(gt=0, le=1e12)
    rate: float = Field(gt=0, le=1e12)
    burst_capacity: float = Field(default=0.0, ge=0, le=1e12)
    burst_rate: float = Field(default=0.0, ge=0, le=1e12)

    def limit(self) -> Limit:
        return Limit(self.capacity, self.rate, self.burst_capacity, self.burst_rate)


class TierQuotaSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: LimitSettings
    tokens: LimitSettings


def _default_quota(tier: Tier) -> dict[str, dict[str, float]]:
    cfg = DEFAULT_TIERS[tier]
    return {
        dim: {
            "capacity": lim.capacity,
            "rate": lim.rate,
            "burst_capacity": lim.burst_capacity,
            "burst_rate": lim.burst_rate,
        }
        for dim, lim in (("requests", cfg.requests), ("tokens", cfg.tokens))
    }


def _merged(base: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in given.items():
        current = out.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            out[key] = _merged(current, value)
        else:
            out[key] = value
    return out


class AdmissionSettings(CommonSettings):
    model_config = SettingsConfigDict(env_nested_delimiter="__")  # merged with the parent's

    quota_basic: TierQuotaSettings = Field(
        default_factory=lambda: TierQuotaSettings.model_validate(_default_quota(Tier.BASIC))
    )
    quota_pro: TierQuotaSettings = Field(
        default_factory=lambda: TierQuotaSettings.model_validate(_default_quota(Tier.PRO))
    )
    quota_enterprise: TierQuotaSettings = Field(
        default_factory=lambda: TierQuotaSettings.model_validate(_default_quota(Tier.ENTERPRISE))
    )
    quota_retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """``Retry-After`` of a basic-tier rejection while Redis is unreachable."""
    redis_timeout_s: float = Field(default=0.5, gt=0, le=60)
    """Socket timeout of the quota store: past it, the tier's Redis-down policy decides."""
    reservation_ttl_s: float = Field(default=3600.0, gt=0, le=86_400)
    """How long a token reservation waits for its completion's correction."""

    small_pool: str = Field(default="small", pattern=r"^[A-Za-z0-9._-]+$")
    enterprise_pools: dict[str, str] = Field(default_factory=dict, max_length=64)
    max_tokens_cap: int = Field(default=512, ge=1, le=32_768)
    """Degradation level 2, when the controller's event carries no cap: requests asking
    for more than this many output tokens (the *long* ones) are truncated to it; shorter
    ones are left alone (capping them would change nothing)."""
    early_rejection: bool = False
    """Refuse at once (``overloaded`` / ``deadline_unreachable``, ``Retry-After``) a
    request whose first token is predicted after its deadline (``ttft``). Off by
    default: the prediction divides by a prefill rate learned from busy intervals,
    which at moderate load measures the load rather than the engines' capacity — in
    ``bench/incident.py`` at 72% of capacity it refused half the VIP requests that
    would have been served in time (``bench/README.md``)."""
    scavenger_tiers: frozenset[Tier] = frozenset()
    """Work-conserving quotas: these tiers' over-quota requests wait for idle capacity
    (served ``scavenged``, shed ``quota_exceeded`` as soon as other work needs the
    pool) instead of being refused at once (JSON list, e.g.
    ``SEAWALL_SCAVENGER_TIERS='["basic", "pro"]'``). Empty by default — strict mode, the
    quotas as hard limits — because it measured worse: in ``bench/incident.py`` the
    extra work served lengthened every engine step and lowered goodput at every load
    (``bench/README.md``)."""
    scavenger_wait_s: float = Field(default=2.0, gt=0, le=3600)
    """How long an over-quota request may wait for idle capacity before it is refused."""
    scavenger_headroom: float = Field(default=0.2, ge=0, lt=1)
    """The share of each pool's budgets over-quota work leaves free for the work that
    may arrive while it runs."""
    consistency_sample: float = Field(default=0.0, ge=0, le=1)
    """The share of repeatable requests — greedy (temperature 0), or sampled with a
    seed — run a second time as a shadow on another worker, whose output is compared
    with the first (``services.workers.shadows``; a pool's mismatch rate alerts, and a
    canary is held to its baseline's). Each shadow costs its pool one more run, so it
    is off by default; 0.01–0.05 is enough to see a rate within minutes."""
    consistency_min_similarity: float = Field(default=0.5, ge=0, le=1)
    """A seeded sampled request's shadow agrees when its text is at least this similar
    (word bigrams); a greedy one's only when the texts are equal."""

    rate_limit_factor: float = Field(default=0.5, gt=0, le=1)
    """Breaker level 2 (rate limit): the share of a pool's batch slots admission fills."""
    breaker_retry_after_s: float = Field(default=5.0, gt=0, le=3600)
    """``Retry-After`` of a rejection by an open breaker (level 3 and up)."""

    pacing_slack: int = Field(default=2, ge=0, le=10_000)
    """Records per pool dispatched beyond the free batch slots, so that a worker finds
    its next request already waiting when a slot frees (hides the fetch latency)."""
    worker_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """A worker not heard from for longer no longer counts towards its pool's capacity."""
    ledger_ttl_s: float = Field(default=600.0, gt=0, le=86_400)
    """How long a dispatched request counts as in the pool without a completion."""
    pacing_prefill_steps: float = Field(default=4.0, gt=0, le=1000)
    """Prompt tokens a worker may hold before their first token, in engine steps'
    worth (``max_num_batched_tokens`` each): the prefill queue every newcomer's TTFT
    waits behind."""
    pacing_kv_fill: float = Field(default=0.9, gt=0, le=1)
    """The share of a worker's KV cache that reservations (prompt + ``max_tokens``) may
    fill, corrected up or down by its reported usage and preemptions."""
    vip_reserve: float = Field(default=0.0, ge=0, lt=1)
    """The share of every pool's batch slots, KV and prefill budget only VIP requests
    may use. Off by default because it measured no better: in ``bench/incident.py`` at
    3x capacity a reserve of 0.1 left VIP P99 where it was (2.57x steady against
    2.60x) and cost 27% of the goodput; VIP latency there is the engines' step time,
    which a reserve of admission budget does not shorten (``bench/README.md``)."""

    max_buffered_per_class: int = Field(default=1000, ge=1, le=1_000_000)
    """Decided requests held per priority class awaiting dispatch; above it the class's
    partitions are paused (the rest waits in Kafka)."""
    intake_batch: int = Field(default=200, ge=1, le=10_000)
    """Records read per fetch (and quota decisions per Redis round trip)."""
    dispatch_interval_s: float = Field(default=0.05, gt=0, le=10)
    """The longest a dispatch round waits for news (new work, telemetry, control)."""
    commit_interval_s: float = Field(default=0.2, gt=0, le=10)

    @field_validator("quota_basic", "quota_pro", "quota_enterprise", mode="before")
    @classmethod
    def _over_defaults(cls, value: object, info: ValidationInfo) -> object:
        """A partial override keeps the tier's defaults for what it does not give."""
        if isinstance(value, Mapping):
            assert info.field_name is not None
            tier = Tier(info.field_name.removeprefix("quota_"))
            return _merged(_default_quota(tier), value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.small_pool not in self.pools:
            raise ValueError(f"small_pool {self.small_pool!r} is not one of pools {self.pools}")
        for pool, dedicated in self.enterprise_pools.items():
            if pool not in self.pools or dedicated not in self.pools:
                raise ValueError(
                    f"enterprise_pools maps {pool!r} to {dedicated!r}: both must be among "
                    f"pools {self.pools}"
                )
        for tier in Tier:
            self.tier_config(tier)  # the bucket model's own checks (basic has no burst, …)
        return self

    def tier_config(self, tier: Tier) -> TierConfig:
        quota: TierQuotaSettings = getattr(self, f"quota_{tier.value}")
        return TierConfig(tier, quota.requests.limit(), quota.tokens.limit())

    def tier_configs(self) -> dict[Tier, TierConfig]:
        return {tier: self.tier_config(tier) for tier in Tier}
