"""What a quota charge asks of the buckets and what it got back (pure data): the store
in ``services.admission.quota`` takes ``Charge``s and answers ``Charged``s, and the
decisions (``decisions.py``) build and read them without touching Redis."""

from __future__ import annotations

from dataclasses import dataclass

from services.admission.policy.bucket import Dimension, QuotaDecision, TierConfig


@dataclass(frozen=True, slots=True)
class QuotaRequest:
    """What one bucket pair (a tenant's, or a region's) is charged."""

    tenant: str
    """The tenant, or for a region's charge the region's name."""
    config: TierConfig
    requests: float = 1
    tokens: float = 0

    @property
    def costs(self) -> dict[Dimension, float]:
        return {"requests": self.requests, "tokens": self.tokens}


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's charge: its tenant's buckets, its region's if throttled, and its
    marker (``None``: not idempotent)."""

    tenant: QuotaRequest
    region: QuotaRequest | None = None
    marker: str | None = None
    """The request's marker key (``RedisKeys.admitted``)."""
    marker_ttl_ms: int = 0
    reservation: str | None = None
    """The request's reservation key (``RedisKeys.reservation``): when the charge is
    made, the tokens charged to the tenant are written there, in the same atomic step,
    for its completion's correction (``None``: not recorded)."""
    reservation_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class Charged:
    tenant: QuotaDecision
    """The tenant's decision (nothing spent if the region refused)."""
    region: QuotaDecision | None
    """The region's, when there was a region to charge (nothing spent if the tenant
    refused)."""
    replayed: bool = False
    """The marker said this request was charged before: the earlier outcomes, nothing
    spent now."""
