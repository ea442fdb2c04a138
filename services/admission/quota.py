"""Tenant quotas in Redis: ``bucket.lua`` (the model of ``bucket.py``) behind an async API.

One EVALSHA per decision, atomic in Redis: both dimensions of a tenant (requests,
tokens) are read, refilled on the Redis server's clock (``TIME``, microseconds), decided
together and written back with a TTL, so any number of admission replicas share one
bucket per tenant without races. Each (tenant, dimension) is one hash,
``<prefix>quota:{<tenant>}:<dimension>``; the braces are a Redis Cluster hash tag, so a
tenant's keys share a slot (the script touches several) while tenants spread over the
cluster.

When Redis cannot be reached the methods raise ``QuotaUnavailable``; the caller then
applies ``on_redis_down``, the per-tier fallback:

- enterprise: fail open (admit) — its capacity is contractual, and an outage of the
  quota store must not become an outage of the paying customer;
- pro: fail open, degraded — served, but at the lower service level;
- basic: fail closed (reject with ``Retry-After``) — the cheapest traffic is the first to
  shed while admission is blind.

Failing open is bounded elsewhere: admission still dispatches only at the pace the pools
absorb, and the breakers still trip on load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, cast

import redis.asyncio as aioredis
import redis.exceptions

from schemas import Tier
from services.admission.bucket import (
    DEFAULT_TTL_MARGIN_MS,
    DIMENSIONS,
    BucketState,
    Dimension,
    Limit,
    Outcome,
    QuotaDecision,
    Take,
    TierConfig,
    assess,
    check_cost,
    check_delta,
    make_decision,
    redis_clock,
)
from services.common.topics import RedisKeys

__all__ = [
    "REDIS_DOWN_OUTCOME",
    "Adjustment",
    "QuotaDecision",
    "QuotaRequest",
    "QuotaUnavailable",
    "RedisQuota",
    "on_redis_down",
    "quota_key",
]

SCRIPT = resources.files("services.admission").joinpath("bucket.lua").read_text(encoding="utf-8")

_UNREACHABLE = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica during failover
    redis.exceptions.ClusterDownError,
)

REDIS_DOWN_OUTCOME: Mapping[Tier, Outcome] = {
    Tier.ENTERPRISE: "admit",
    Tier.PRO: "degrade",
    Tier.BASIC: "reject",
}


class QuotaUnavailable(RuntimeError):
    """The quota store (Redis) could not be reached; apply ``on_redis_down``."""


def on_redis_down(tier: Tier, retry_after_s: float = 1.0) -> QuotaDecision:
    """The decision when the quota store is down (policy in the module docstring)."""
    outcome = REDIS_DOWN_OUTCOME[tier]
    retry = retry_after_s if outcome == "reject" else 0.0
    return QuotaDecision(outcome, "quota_unavailable", retry_after_s=retry)


def quota_key(prefix: str, tenant: str, dimension: Dimension) -> str:
    """The hash of one (tenant, dimension); the tenant is the cluster hash tag."""
    if "{" in prefix or "}" in prefix:
        raise ValueError("the key prefix must not contain braces (it would be the hash tag)")
    if not tenant or "{" in tenant or "}" in tenant:
        raise ValueError("a tenant id must be non-empty and free of braces")
    return RedisKeys(prefix).quota(tenant, dimension)


@dataclass(frozen=True, slots=True)
class QuotaRequest:
    tenant: str
    config: TierConfig
    requests: float = 1
    tokens: float = 0


@dataclass(frozen=True, slots=True)
class Adjustment:
    """The tokens bucket after a completion correction."""

    at: float
    """The Redis server clock the script used."""
    tokens: Take


@contextmanager
def _store_errors() -> Iterator[None]:
    try:
        yield
    except _UNREACHABLE as exc:
        raise QuotaUnavailable(f"quota store unreachable ({type(exc).__name__})") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(reply: Sequence[bytes | str]) -> tuple[str, float, list[BucketState]]:
    """The script's reply: outcome, server clock, then (tokens, ts, burst) per key."""
    now = redis_clock(int(reply[1]), int(reply[2]))
    values = [float(v) for v in reply[3:]]
    states = [BucketState(*values[i : i + 3]) for i in range(0, len(values), 3)]
    return _text(reply[0]), now, states


class RedisQuota:
    """Atomic per-tenant quota buckets in Redis (works with Redis ≥ 5, and Cluster)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        key_prefix: str,
        *,
        ttl_margin_ms: int = DEFAULT_TTL_MARGIN_MS,
    ) -> None:
        self._redis = redis
        self._prefix = key_prefix
        self._margin = ttl_margin_ms
        self._script = redis.register_script(SCRIPT)

    def _args(
        self, mode: Literal["take", "adjust"], items: Sequence[tuple[float, Limit]]
    ) -> list[str | int | float]:
        args: list[str | int | float] = [mode, self._margin]
        for cost, lim in items:
            args += [cost, lim.capacity, lim.rate, lim.burst_capacity, lim.burst_rate]
        return args

    def _take_call(self, item: QuotaRequest) -> tuple[list[str], list[str | int | float]]:
        check_cost(item.requests)
        check_cost(item.tokens)
        costs: dict[Dimension, float] = {"requests": item.requests, "tokens": item.tokens}
        keys = [quota_key(self._prefix, item.tenant, d) for d in DIMENSIONS]
        args = self._args("take", [(costs[d], item.config.limit(d)) for d in DIMENSIONS])
        return keys, args

    @staticmethod
    def _decision(item: QuotaRequest, reply: Sequence[bytes | str]) -> QuotaDecision:
        outcome, now, states = _parse(reply)
        if outcome not in ("admit", "degrade", "reject"):
            raise RuntimeError(f"unexpected quota script outcome {outcome!r}")
        costs: dict[Dimension, float] = {"requests": item.requests, "tokens": item.tokens}
        limits = {d: item.config.limit(d) for d in DIMENSIONS}
        allowed = outcome != "reject"
        takes = {
            d: assess(s, costs[d], limits[d], allowed)
            for d, s in zip(DIMENSIONS, states, strict=True)
        }
        return make_decision(cast(Outcome, outcome), takes, costs, limits, now)

    async def decide(
        self, tenant: str, config: TierConfig, requests: float = 1, tokens: float = 0
    ) -> QuotaDecision:
        """Charge ``requests`` and ``tokens`` (reserve ``prompt + max_tokens``) to a tenant."""
        item = QuotaRequest(tenant, config, requests, tokens)
        keys, args = self._take_call(item)
        with _store_errors():
            reply = await self._script(keys=keys, args=args)
        return self._decision(item, cast(Sequence[bytes | str], reply))

    async def decide_many(self, items: Sequence[QuotaRequest]) -> list[QuotaDecision]:
        """Several decisions in one round trip (a pipeline of EVALSHAs, each atomic)."""
        if not items:
            return []
        calls = [self._take_call(item) for item in items]
        with _store_errors():
            async with self._redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    await self._script(keys=keys, args=args, client=pipe)
                replies: list[Any] = await pipe.execute()
        return [self._decision(item, r) for item, r in zip(items, replies, strict=True)]

    async def adjust(self, tenant: str, config: TierConfig, tokens_delta: float) -> Adjustment:
        """Apply ``actual - reserved`` tokens at completion (negative refunds)."""
        check_delta(tokens_delta)
        key = quota_key(self._prefix, tenant, "tokens")
        args = self._args("adjust", [(tokens_delta, config.tokens)])
        with _store_errors():
            reply = await self._script(keys=[key], args=args)
        _, now, (state,) = _parse(cast(Sequence[bytes | str], reply))
        return Adjustment(now, assess(state, 0.0, config.tokens, allowed=True))
