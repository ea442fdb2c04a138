"""What a quota charge asks of the buckets and what it got back (pure): the store in
``services.admission.quota`` takes ``Charge``s and answers ``Charged``s, and the
decisions (``decisions.py``) build and read them without touching Redis."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.admission.policy.bucket import (
    DIMENSIONS,
    BucketState,
    Dimension,
    Limit,
    QuotaDecision,
    Take,
    TierConfig,
    assess,
)


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


class Assessed(Mapping[Dimension, Take]):
    """The ``Take`` of each dimension of an admitted charge, assessed when first read.

    ``figures`` are the buckets' stored states, flat (tokens, ts, burst per dimension, in
    ``DIMENSIONS`` order), as the quota script returns them. Only a rejection puts these
    figures on a reply; an admitted request's are read by tests and views at most, and
    building them for every request was a tenth of admission's time."""

    __slots__ = ("_costs", "_figures", "_limits", "_takes")

    def __init__(
        self,
        figures: Sequence[float | str | bytes],
        costs: Sequence[float],
        limits: Sequence[Limit],
    ) -> None:
        self._figures = figures
        self._costs = costs
        self._limits = limits
        self._takes: dict[Dimension, Take] | None = None

    def _assessed(self) -> dict[Dimension, Take]:
        if self._takes is None:
            f = self._figures
            self._takes = {
                d: assess(
                    BucketState(float(f[3 * i]), float(f[3 * i + 1]), float(f[3 * i + 2])),
                    self._costs[i],
                    self._limits[i],
                    allowed=True,
                )
                for i, d in enumerate(DIMENSIONS)
            }
        return self._takes

    def __getitem__(self, dimension: Dimension) -> Take:
        return self._assessed()[dimension]

    def __iter__(self) -> Iterator[Dimension]:
        return iter(DIMENSIONS)

    def __len__(self) -> int:
        return len(DIMENSIONS)
