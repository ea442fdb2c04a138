"""What admission's per-request decisions are configured with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas import Tier
from services.admission.policy.bucket import TierConfig


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
    sampling_secret: bytes = field(default=b"", repr=False)
    """The key of the canary split's and the shadow sample's hashes (``services.common.
    sampling``). The service always sets it from ``SEAWALL_SAMPLING_SECRET_FILE`` and
    does not start without one; empty (the default, for the pure tests) is an unkeyed
    hash that anyone can compute."""
