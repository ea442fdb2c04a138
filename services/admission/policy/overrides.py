"""Region throttles and quota overrides, as the control state holds them (pure).

Region throttle (``RegionThrottle`` for ``request.client.region``): a shared bucket of
``rate_per_s`` requests per second, one second deep (at least one request); rate 0
blocks the region; over it → rejected (``region_throttled``). Quota override
(``QuotaOverride`` for the tenant, until ``expires_at``): ``requests_per_s`` and
``tokens_per_s`` replace the baseline rates, ``burst`` the depth of the requests
bucket; a 0 blocks the tenant.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import quote

from schemas import QuotaOverride, RegionThrottle
from services.admission.policy.bucket import TierConfig
from services.common.control_state import ControlState


def region_bucket(region: str) -> str:
    """The quota-store name of a region's bucket (quoted: no braces, no collisions;
    region buckets have their own key namespace, ``RedisKeys.region_quota``)."""
    return quote(region, safe="")


REGION_SCOPES = ("region:", "hotspot:")
"""Where a region's throttles are: the operator's (``seawall region throttle``) and the
controller's hotspot detection (``controller.regions``)."""


def region_throttle(control: ControlState, region: str) -> RegionThrottle | None:
    """The throttle in force for a region: the latest issued of the events at its two
    exact scopes (``REGION_SCOPES``), so that an operator's later throttle or lift wins
    over the controller's. One under any other scope naming the region is ignored: the
    operator's lift could never reach it."""
    if not region:
        return None
    found = [
        e
        for prefix in REGION_SCOPES
        if (e := control.get(RegionThrottle, f"{prefix}{region}")) is not None
        and e.region == region
    ]
    latest = max(found, key=lambda t: (t.issued_at, t.seq), default=None)
    return latest if latest is not None and latest.rate_per_s is not None else None


def quota_override(control: ControlState, tenant: str, now: float) -> QuotaOverride | None:
    """The tenant's override in force: the event at its exact scope, ``tenant:<tenant>``
    (``seawall quota set`` and ``quota clear`` write there, so a clear always lifts it;
    one under any other scope naming the tenant — ``tenant:<victim>/x`` — is ignored)."""
    o = control.get(QuotaOverride, f"tenant:{tenant}")
    if o is None or o.tenant != tenant or (o.expires_at is not None and now >= o.expires_at):
        return None
    return o


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
