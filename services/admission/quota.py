"""Tenant quotas in Redis: ``bucket.lua`` (the model of ``policy/bucket.py``) behind an async API.

Each charge is atomic in Redis (a batch of charges is one script call, or a few:
``CHARGES_PER_CALL``): both dimensions of a tenant (requests,
tokens) — and, for a request from a throttled region, the region's bucket — are read,
refilled on the Redis server's clock (``TIME``, microseconds), decided together and
written back with a TTL, so any number of admission replicas share one bucket per
tenant without races. A refused region charges no tenant and a refused tenant charges
no region. Each (tenant, dimension) is one hash, ``<prefix>quota:{<tenant>}:<dimension>``;
the braces are a Redis Cluster hash tag, so a tenant's keys share a slot (the script
touches several) while tenants spread over the cluster. Region buckets have their own
namespace, ``<prefix>region:{<region>}:<dimension>`` (a tenant cannot share a region's
keys by its name); a charge with a region touches two slots, which Redis Cluster refuses
in one script — region throttles are for a single Redis, or a cluster whose region and
tenant keys an operator co-locates.

Idempotent: a charge may carry its request's marker key (``RedisKeys.admitted``, in the
tenant's slot). The script records the outcomes there (with a TTL past the request's
deadline); a request charged again — redelivered after a crash, or produced twice —
gets the same outcomes back (``Charged.replayed``) and pays nothing. A charge may also
carry its request's reservation key (``RedisKeys.reservation``, in the tenant's slot):
the tokens it charged the tenant are written there in the same step, so a charge is
never made without the record its completion corrects it from.

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

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Literal, cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from schemas import Tier
from seawall_client.topics import RedisKeys
from services.admission.policy.bucket import (
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
from services.admission.policy.charges import Assessed, Charge, Charged, QuotaRequest
from services.common.failures import StoreUnavailable
from services.common.lua import Call, Lua

__all__ = [
    "REDIS_DOWN_OUTCOME",
    "Adjustment",
    "QuotaDecision",
    "QuotaUnavailable",
    "RedisQuota",
    "on_redis_down",
    "quota_key",
    "region_key",
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


class QuotaUnavailable(StoreUnavailable):
    """The quota store (Redis) could not be reached; apply ``on_redis_down``."""


def on_redis_down(tier: Tier, retry_after_s: float = 1.0) -> QuotaDecision:
    """The decision when the quota store is down (policy in the module docstring)."""
    outcome = REDIS_DOWN_OUTCOME[tier]
    retry = retry_after_s if outcome == "reject" else 0.0
    return QuotaDecision(outcome, "quota_unavailable", retry_after_s=retry)


def _check_tag(prefix: str, name: str) -> None:
    if "{" in prefix or "}" in prefix:
        raise ValueError("the key prefix must not contain braces (it would be the hash tag)")
    if not name or "{" in name or "}" in name:
        raise ValueError("a tenant or region name must be non-empty and free of braces")


def quota_key(prefix: str, tenant: str, dimension: Dimension) -> str:
    """The hash of one (tenant, dimension); the tenant is the cluster hash tag."""
    _check_tag(prefix, tenant)
    return RedisKeys(prefix).quota(tenant, dimension)


def region_key(prefix: str, region: str, dimension: Dimension) -> str:
    """The hash of one (region, dimension), in the regions' own namespace."""
    _check_tag(prefix, region)
    return RedisKeys(prefix).region_quota(region, dimension)


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


def _parse(reply: Sequence[bytes | str]) -> tuple[str, float, str, bool, Sequence[bytes | str]]:
    """The script's reply: tenant outcome, server clock, region outcome, replayed, then
    the figures (tokens, ts, burst) of each bucket, flat."""
    now = redis_clock(int(reply[1]), int(reply[2]))
    return _text(reply[0]), now, _text(reply[3]), int(reply[4]) == 1, reply[5:]


def _states(figures: Sequence[bytes | str]) -> list[BucketState]:
    values = [float(v) for v in figures]
    return [BucketState(*values[i : i + 3]) for i in range(0, len(values), 3)]


@functools.lru_cache(maxsize=1024)
def _limit_figures(lim: Limit) -> str:
    """A limit's four figures as the script reads them, written once per limit: ``repr``
    of each float, the shortest text that reads back as the same double."""
    return " ".join(repr(v) for v in (lim.capacity, lim.rate, lim.burst_capacity, lim.burst_rate))


CHARGES_PER_CALL = 64
"""At most this many charges in one script call. Redis runs a call to its end before
anything else (a charge takes it tens of microseconds), so a call of 64 holds it a few
milliseconds at most, while a batch of requests still costs a handful of calls."""


class _Call:
    """One script call being built: its keys, its table of distinct limits (a tier's
    eight figures travel once per call, not once per request), its charges' figures.

    The figures travel as one argument of space-separated numbers (``bucket.lua``
    splits it): as a dozen arguments per charge, redis-py's encoding and packing of
    each cost admission 8 µs per charge, two thirds of building the call."""

    __slots__ = ("figures", "keys", "limits", "mode", "size")

    def __init__(self, mode: Literal["take", "adjust"]) -> None:
        self.mode = mode
        self.keys: list[str] = []
        self.limits: dict[Limit, int] = {}
        self.figures: list[str] = []
        self.size = 0

    def add(
        self,
        buckets: Sequence[tuple[str, float, Limit]],
        split: int = 0,
        marker: tuple[str, int] | None = None,
        reservation: tuple[str, int] | None = None,
    ) -> None:
        """One charge: its buckets (key, cost, limit), how many of the first are a
        region's, its marker and reservation (key, TTL in ms)."""
        figures: list[str] = []
        for key, cost, lim in buckets:
            self.keys.append(key)
            index = self.limits.setdefault(lim, len(self.limits) + 1)
            figures += (repr(cost), repr(index))
        nkeys = len(buckets)
        ttls = ["0", "0"]
        for i, extra in enumerate((marker, reservation)):
            if extra is not None:
                self.keys.append(extra[0])
                ttls[i] = repr(max(1, extra[1]))
                nkeys += 1
        self.figures += (repr(nkeys), repr(split), *ttls, *figures)
        self.size += 1

    def call(self, margin: int) -> Call:
        figures = " ".join(
            [repr(len(self.limits)), *map(_limit_figures, self.limits), *self.figures]
        )
        return self.keys, [self.mode, margin, figures]


def _decision(
    item: QuotaRequest, outcome: str, now: float, figures: Sequence[bytes | str]
) -> QuotaDecision:
    costs = (item.requests, item.tokens)
    limits = (item.config.requests, item.config.tokens)
    if outcome == "admit":
        # The figures are assessed if read (``Assessed``): an admitted request's rarely are.
        return QuotaDecision("admit", "ok", Assessed(figures, costs, limits), 0.0, now)
    if outcome == "degrade":
        return QuotaDecision("degrade", "burst", Assessed(figures, costs, limits), 0.0, now)
    if outcome != "reject":
        raise RuntimeError(f"unexpected quota script outcome {outcome!r}")
    takes = {
        d: assess(s, cost, lim, allowed=False)
        for d, s, cost, lim in zip(DIMENSIONS, _states(figures), costs, limits, strict=True)
    }
    return make_decision(
        "reject", takes, item.costs, dict(zip(DIMENSIONS, limits, strict=True)), now
    )


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
        self._script = Lua(redis, SCRIPT)
        self._cluster = isinstance(redis, RedisCluster)

    def _slot_of(self, charge: Charge) -> int:
        """The call a charge joins: on a cluster, its tenant's hash slot (a script's keys
        must share one); on a single Redis, any."""
        if not self._cluster:
            return 0
        return key_slot(quota_key(self._prefix, charge.tenant.tenant, "requests").encode())

    def _calls(self, charges: Sequence[Charge]) -> list[tuple[_Call, list[int]]]:
        """The script calls deciding ``charges``, each with the indices of its charges."""
        open_calls: dict[int, tuple[_Call, list[int]]] = {}
        calls: list[tuple[_Call, list[int]]] = []
        for index, charge in enumerate(charges):
            slot = self._slot_of(charge)
            current = open_calls.get(slot)
            if current is None or current[0].size >= CHARGES_PER_CALL:
                current = open_calls[slot] = (_Call("take"), [])
                calls.append(current)
            self._add(current[0], charge)
            current[1].append(index)
        return calls

    def _add(self, call: _Call, charge: Charge) -> None:
        buckets: list[tuple[str, float, Limit]] = []
        groups = [(charge.region, region_key)] if charge.region is not None else []
        for item, key in [*groups, (charge.tenant, quota_key)]:
            check_cost(item.requests)
            check_cost(item.tokens)
            costs = item.costs
            buckets += (
                (key(self._prefix, item.tenant, d), costs[d], item.config.limit(d))
                for d in DIMENSIONS
            )
        call.add(
            buckets,
            len(DIMENSIONS) if charge.region is not None else 0,
            None if charge.marker is None else (charge.marker, charge.marker_ttl_ms),
            None if charge.reservation is None else (charge.reservation, charge.reservation_ttl_ms),
        )

    @staticmethod
    def _charged(charge: Charge, reply: Sequence[bytes | str]) -> Charged:
        tenant_outcome, now, region_outcome, replayed, figures = _parse(reply)
        n = 3 * len(DIMENSIONS)
        region = None
        if charge.region is not None:
            region = _decision(charge.region, region_outcome, now, figures[:n])
            figures = figures[n:]
        tenant = _decision(charge.tenant, tenant_outcome, now, figures)
        return Charged(tenant, region, replayed)

    async def decide(
        self, tenant: str, config: TierConfig, requests: float = 1, tokens: float = 0
    ) -> QuotaDecision:
        """Charge ``requests`` and ``tokens`` (reserve ``prompt + max_tokens``) to a tenant."""
        (charged,) = await self.charge_many(
            [Charge(QuotaRequest(tenant, config, requests, tokens))]
        )
        return charged.tenant

    async def decide_many(self, items: Sequence[QuotaRequest]) -> list[QuotaDecision]:
        """Several tenants' decisions in one round trip (see ``charge_many``)."""
        return [c.tenant for c in await self.charge_many([Charge(i) for i in items])]

    async def charge_many(self, charges: Sequence[Charge]) -> list[Charged]:
        """Several charges in one round trip: script calls of up to ``CHARGES_PER_CALL``
        charges each (grouped by hash slot on a cluster), pipelined; every charge is
        atomic, and they are decided in order."""
        if not charges:
            return []
        calls = self._calls(charges)
        with _store_errors():
            replies = await self._script.many([call.call(self._margin) for call, _ in calls])
        charged: list[Charged | None] = [None] * len(charges)
        for (_, indices), reply in zip(calls, replies, strict=True):
            for index, one in zip(indices, reply, strict=True):
                charged[index] = self._charged(charges[index], one)
        return cast(list[Charged], charged)

    async def adjust(self, tenant: str, config: TierConfig, tokens_delta: float) -> Adjustment:
        """Apply ``actual - reserved`` tokens at completion (negative refunds)."""
        check_delta(tokens_delta)
        call = _Call("adjust")
        call.add([(quota_key(self._prefix, tenant, "tokens"), tokens_delta, config.tokens)])
        with _store_errors():
            (reply,) = await self._script(*call.call(self._margin))
        _, now, _, _, figures = _parse(cast(Sequence[bytes | str], reply))
        (state,) = _states(figures)
        return Adjustment(now, assess(state, 0.0, config.tokens, allowed=True))
