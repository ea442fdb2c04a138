"""Operators steer at run time: live tenant quotas and region throttles (issue 16, item 2).

``seawall quota set|clear`` and ``seawall region throttle|lift`` publish control events
(``QuotaOverride``, ``RegionThrottle``) on the control topic, where every admission
replica follows them (within a broker hop: well inside the 5 s the seed asks for) and
``seawall events`` shows them with who issued them and why.

An operator's decision is not re-published by anybody: it is valid for its ``--ttl``
(``valid_for_s`` and, for a quota, ``expires_at``; at most a day, the wire's bound),
after which every consumer falls back to the tier's quota or no throttle. Clearing
publishes, for the same key, an event without terms, which replaces the one in force.

``seq`` is the hybrid clock the controller uses too (µs since the epoch, at least one
more than ``--after``): a later command wins over an earlier one for the same key.
"""

from __future__ import annotations

import asyncio
import getpass
import re
from typing import Any

from schemas import ControlEvent, Evidence, QuotaOverride, RegionThrottle
from services.common.bus import make_producer, topics_of
from services.common.serde import encode
from services.common.settings import CommonSettings

MAX_TTL_S = 86_400.0
DEFAULT_TTL_S = 3_600.0
CLEARED_VALID_S = 60.0
"""How long a clearing event stays: long enough for every replica to read it."""


def operator(name: str | None = None) -> str:
    """The issuer of an operator's events: ``operator:<login>`` (an ``Ident``)."""
    who = name or getpass.getuser() or "unknown"
    return "operator:" + (re.sub(r"[^A-Za-z0-9._@-]", "-", who)[:100] or "unknown")


def _header(
    scope: str, issuer: str, now: float, valid_for_s: float, reason: str, **metrics: float
) -> dict[str, Any]:
    """What every operator's event carries: its key's scope, the hybrid-clock ``seq``,
    when, for how long, who and why."""
    return {
        "scope": scope,
        "seq": int(now * 1_000_000),
        "issued_at": now,
        "valid_for_s": valid_for_s,
        "issuer": issuer,
        "evidence": Evidence(reason=reason[:512], metrics=metrics),
    }


def _check_ttl(ttl_s: float) -> None:
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"--ttl must be in (0, {MAX_TTL_S:g}] seconds, got {ttl_s:g}")


def quota_set(
    tenant: str,
    *,
    requests_per_s: float | None,
    tokens_per_minute: float | None,
    burst: float | None,
    ttl_s: float,
    reason: str,
    issuer: str,
    now: float,
) -> QuotaOverride:
    """A tenant's quota for ``ttl_s``: requests per second, tokens per minute, the
    requests bucket's size (``None``: the tier's; 0 suspends the tenant)."""
    _check_ttl(ttl_s)
    if requests_per_s is None and tokens_per_minute is None and burst is None:
        raise ValueError("give at least one of --rps, --tpm and --burst")
    tokens_per_s = None if tokens_per_minute is None else tokens_per_minute / 60.0
    terms = {"requests_per_s": requests_per_s, "tokens_per_s": tokens_per_s, "burst": burst}
    given = {k: v for k, v in terms.items() if v is not None}
    return QuotaOverride(
        **_header(f"tenant:{tenant}", issuer, now, ttl_s, reason, ttl_s=ttl_s, **given),
        tenant=tenant,
        expires_at=now + ttl_s,
        **terms,
    )


def quota_clear(tenant: str, *, reason: str, issuer: str, now: float) -> QuotaOverride:
    """Back to the tier's quota: an override without terms, in place of the one in
    force."""
    return QuotaOverride(
        **_header(f"tenant:{tenant}", issuer, now, CLEARED_VALID_S, reason), tenant=tenant
    )


def region_throttle(
    region: str,
    *,
    rate_per_s: float | None,
    ttl_s: float,
    reason: str,
    issuer: str,
    now: float,
) -> RegionThrottle:
    """Requests admitted per second from ``region`` (0 suspends it; ``None`` lifts the
    throttle)."""
    _check_ttl(ttl_s)
    scope = f"region:{region}"
    if rate_per_s is None:
        header = _header(scope, issuer, now, CLEARED_VALID_S, reason)
    else:
        header = _header(scope, issuer, now, ttl_s, reason, rate_per_s=rate_per_s, ttl_s=ttl_s)
    return RegionThrottle(**header, region=region, rate_per_s=rate_per_s)


async def publish(settings: CommonSettings, event: ControlEvent, timeout_s: float = 10.0) -> None:
    """Send the event to the control topic and wait for the broker's ack."""
    producer = make_producer(settings)
    try:
        async with asyncio.timeout(timeout_s):
            await producer.start()
            await producer.send_and_wait(
                topics_of(settings).control, encode(event), key=event.control_key.encode()
            )
    finally:
        await producer.stop()
