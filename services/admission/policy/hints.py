"""Which quota rejections become ``QuotaHint``s for ingress (pure).

A rejection hints only when its tenant's *requests* bucket is what cannot pay: then no
request of that tenant can be admitted until that bucket holds one request again
(``Take.retry_after_s`` of the requests dimension, whose cost is always one), whatever
the request. A rejection on tokens alone, or one the tier turns into scavenger work, or
one that no retry can cure, hints nothing.

When a tenant's quota changes (a ``QuotaOverride`` comes, goes or changes), what its
last hint said may no longer hold: ``clear_hint`` tells ingress to drop it.

Admission sees a flood of one tenant as many rejections with nearly the same ``until``:
``HintThrottle`` publishes a tenant's hint only when it extends the last one published
by at least ``min_extension_s``, so the hint topic carries about one record per tenant
per refill interval, not one per refused request. It forgets tenants whose hint has
passed, and holds at most ``max_tenants``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas import QuotaHint, RateLimitInfo
from services.admission.policy.bucket import QuotaDecision


def hint_for(tenant: str, decision: QuotaDecision) -> QuotaHint | None:
    """The hint a tenant's rejected quota decision makes, if any (``decision.at``: the
    quota store's clock, as every hint's ``until``)."""
    requests = decision.dimensions.get("requests")
    if (
        decision.outcome != "reject"
        or decision.reason != "quota_exhausted"
        or requests is None
        or decision.at is None
        or not 0 < requests.retry_after_s < math.inf
    ):
        return None
    info = decision.rate_limit_info()
    if info is None:
        return None
    return QuotaHint(
        tenant=tenant,
        until=decision.at + requests.retry_after_s,
        issued_at=decision.at,
        rate_limit=info,
    )


def clear_hint(tenant: str, now: float) -> QuotaHint:
    """The hint that clears ``tenant``'s (``until`` = ``issued_at``)."""
    return QuotaHint(
        tenant=tenant,
        until=now,
        issued_at=now,
        rate_limit=RateLimitInfo(limit=0, remaining=0, reset_s=0.0),
    )


@dataclass
class HintThrottle:
    min_extension_s: float = 0.25
    max_tenants: int = 100_000

    def __post_init__(self) -> None:
        self._until: dict[str, float] = {}

    def admit(self, hint: QuotaHint) -> bool:
        """Whether to publish ``hint`` (and remember it as published)."""
        published = self._until.get(hint.tenant)
        if published is not None and hint.until < published + self.min_extension_s:
            return False
        if published is None and len(self._until) >= self.max_tenants:
            self._forget(hint.issued_at)
            if len(self._until) >= self.max_tenants:
                return False  # every remembered hint is live: this one waits its turn
        self._until[hint.tenant] = hint.until
        return True

    def forget(self, tenant: str) -> None:
        """The tenant's next hint is published whatever the last said (its quota
        changed)."""
        self._until.pop(tenant, None)

    def _forget(self, now: float) -> None:
        for tenant in [t for t, until in self._until.items() if until <= now]:
            del self._until[tenant]

    def __len__(self) -> int:
        return len(self._until)
