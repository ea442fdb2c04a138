"""Operators steer at run time: live tenant quotas, region throttles, canary releases.

``seawall quota set|clear`` and ``seawall region throttle|lift`` publish control events
(``QuotaOverride``, ``RegionThrottle``) on the control topic, where every admission
replica follows them (within a broker hop: well inside the 5 s the seed asks for) and
``seawall events`` shows them with who issued them and why.

An operator's decision is not re-published by anybody: it is valid for its ``--ttl``
(``valid_for_s`` and, for a quota, ``expires_at``; at most a day, the wire's bound),
after which every consumer falls back to the tier's quota or no throttle. Clearing
publishes, for the same key, an event without terms, which replaces the one in force.

``seawall canary start|promote|abort`` publish a ``CanaryRelease`` for the controller,
which runs the release and publishes the pool's ``TrafficSplit``; a release's command
holds for a day (the wire's bound), so a release must end within it.

``seq`` is the hybrid clock the controller uses too (µs since the epoch, at least one
more than ``--after``): a later command wins over an earlier one for the same key.
"""

from __future__ import annotations

import asyncio
import getpass
import re
import time
from typing import Any

from schemas import (
    CanaryRelease,
    ControlEvent,
    Evidence,
    Profile,
    QuotaOverride,
    RegionThrottle,
)
from seawall.reading import catch_up_consumer, partitions, read_to_end
from seawall_client.kafka import ensure_topics
from seawall_client.serde import CONTROL, DecodeError, decode
from seawall_client.topics import canary_pool
from services.common.bus import make_producer, topics_of
from services.common.control_signing import send_signed, signer_for, verifier_for
from services.common.control_state import ControlState
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


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str) -> float:
    """``300``, ``30s``, ``5m`` or ``1h`` in seconds."""
    value = text.strip().lower()
    unit = _UNITS.get(value[-1:])
    try:
        seconds = float(value[:-1] if unit else value) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (e.g. 300, 30s, 5m, 1h)") from None
    if not 0 <= seconds <= MAX_TTL_S:
        raise ValueError(f"a duration must be in [0, {MAX_TTL_S:g}] seconds, got {text!r}")
    return seconds


def percent_steps(text: str) -> tuple[float, ...]:
    """``5,25,50,100`` (percent of the pool's traffic) as shares."""
    try:
        return tuple(float(p) / 100.0 for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"steps are percents separated by commas, got {text!r}") from None


def canary_start(
    pool: str,
    version: str,
    *,
    steps: tuple[float, ...],
    hold_s: float,
    check_s: float,
    min_requests: int,
    max_error_rate_delta: float,
    max_latency_ratio: float,
    max_ttft_ratio: float,
    reason: str,
    max_mismatch_rate_delta: float = 0.05,
    issuer: str,
    now: float,
) -> CanaryRelease:
    """A release of ``version`` into ``pool``, which must end within its command's day."""
    total_s = check_s + hold_s * len(steps)
    if total_s > MAX_TTL_S * 0.9:
        raise ValueError(
            f"the release would take {total_s:g} s (check + a hold per step); it must end "
            f"well within a day ({MAX_TTL_S:g} s)"
        )
    header = _header(f"pool:{pool}", issuer, now, MAX_TTL_S, reason)
    return CanaryRelease(
        **header,
        pool=pool,
        version=version,
        action="start",
        release=header["seq"],
        steps=steps,
        hold_s=hold_s,
        check_s=check_s,
        min_requests=min_requests,
        max_error_rate_delta=max_error_rate_delta,
        max_latency_ratio=max_latency_ratio,
        max_ttft_ratio=max_ttft_ratio,
        max_mismatch_rate_delta=max_mismatch_rate_delta,
    )


def canary_command(
    running: CanaryRelease, action: str, *, reason: str, issuer: str, now: float
) -> CanaryRelease:
    """``promote`` or ``abort`` for the release ``running`` is the latest command of."""
    if action not in ("promote", "abort"):
        raise ValueError(f"unknown action {action!r}")
    header = _header(running.scope, issuer, now, MAX_TTL_S, reason)
    return running.model_copy(update={**header, "action": action})


async def read_control(settings: CommonSettings, timeout_s: float = 10.0) -> ControlState:
    """The control topic's latest event per key, read from its start to its end now
    (expired ones kept: ``in_force_only=False``)."""
    state = ControlState(in_force_only=False)
    verifier = verifier_for(settings)
    """What the followers refuse is no decision: the views leave it out too."""
    topic = topics_of(settings).control
    consumer = catch_up_consumer(settings)
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            tps = partitions(consumer, topic)
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            async for _, record in read_to_end(consumer, tps):
                try:
                    event = decode(CONTROL, record.value)
                except DecodeError:
                    continue  # admission dead-letters it; nothing to steer by
                if verifier is None or verifier.check(record.value, record.headers, event) is None:
                    state.apply(event)
    finally:
        await consumer.stop()
    return state


PROFILE_VALID_S = 60.0
"""How long a profiling request may wait for its worker (then it is not run)."""


def profile_request(
    worker_id: str, *, seconds: float, reason: str, issuer: str, now: float
) -> Profile:
    """Ask one worker to profile itself for ``seconds``."""
    header = _header(f"worker:{worker_id}", issuer, now, PROFILE_VALID_S, reason)
    return Profile(
        **header,
        worker_id=worker_id,
        request=header["seq"],
        seconds=seconds,
        status="requested",
    )


async def await_profile(
    settings: CommonSettings, request: Profile, timeout_s: float
) -> Profile | None:
    """The worker's final answer to ``request`` (``written`` or ``failed``), read from
    the control topic; ``None`` if none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await read_control(settings)
        latest = state.get(Profile, request.scope)
        if (
            latest is not None
            and latest.request == request.request
            and latest.status in ("written", "failed")
        ):
            return latest
        await asyncio.sleep(1.0)
    return None


async def create_canary_topic(settings: CommonSettings, pool: str, version: str) -> None:
    """The canary pool's dispatch topic, before any split can send work to it (its
    workers create it too; the broker's auto-creation is never relied on)."""
    topics = topics_of(settings)
    spec = topics.dispatch_spec(canary_pool(pool, version))
    await ensure_topics(settings.kafka, [spec])


def issuer_of(settings: CommonSettings) -> str:
    """Who this operator's events are issued by: the principal of the operator key
    (``control_keys_dir``) where signatures are on, the login where they are off."""
    signer = signer_for(settings, "operator")
    return operator() if signer is None else signer.principal


async def publish(settings: CommonSettings, event: ControlEvent, timeout_s: float = 10.0) -> None:
    """Sign the event with the operator's key (where signatures are on), send it to the
    control topic and wait for the broker's ack. An event naming another issuer than
    the key's principal is refused here: every follower would refuse it."""
    signer = signer_for(settings, "operator")
    if signer is not None and event.issuer != signer.principal:
        raise ValueError(
            f"this operator key signs as {signer.principal!r}; the event names {event.issuer!r}"
        )
    producer = make_producer(settings)
    try:
        async with asyncio.timeout(timeout_s):
            await producer.start()
            await send_signed(producer, topics_of(settings).control, [event], signer)
    finally:
        await producer.stop()
