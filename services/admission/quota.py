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
keys by its name). On a single Redis a charge with a region is one script call. On a
Redis Cluster the two live in different slots, which no script may span: the region is
charged first, then the tenant, and the region is given back what it was charged for a
request whose tenant refused it or had already paid (a replay) — the same outcomes,
decided in two steps (a stop between them leaves a region charged for a request it did
not serve, until its bucket refills).

Idempotent: a charge may carry its request's marker key (``RedisKeys.admitted``, in the
tenant's slot). The script records the outcomes there (with a TTL past the request's
deadline); a request charged again — redelivered after a crash, or produced twice —
gets the same outcomes back (``Charged.replayed``) and pays nothing. A charge may also
carry its request's reservation key (``RedisKeys.reservation``, in the tenant's slot):
the tokens it charged the tenant are written there in the same step, so a charge is
never made without the record its completion corrects it from.

When Redis cannot serve — unreachable, timing out, failing over, at ``maxmemory``,
busy (``failures.redis_unavailable``) — the methods raise ``QuotaUnavailable``; any
other Redis error says the call itself was wrong and is raised as it is (admission
answers the requests of that call with it). On ``QuotaUnavailable`` the caller applies
``on_redis_down``, the per-tier fallback:

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import resources
from typing import Literal, cast

import redis.asyncio as aioredis
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
from services.common.failures import StoreUnavailable, redis_unavailable
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
    except Exception as exc:
        if not redis_unavailable(exc):
            raise
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


KeyOf = Callable[[str, str, Dimension], str]


@dataclass(frozen=True, slots=True)
class _Part:
    """What one charge of the script decides: its bucket pairs (a region's first, if
    it has two), its marker and its reservation (key, TTL in ms)."""

    groups: tuple[tuple[QuotaRequest, KeyOf], ...]
    marker: tuple[str, int] | None = None
    reservation: tuple[str, int] | None = None

    @staticmethod
    def of(charge: Charge, *, region: bool = True) -> _Part:
        """The whole charge (``region``: with its region's pair, if it has one)."""
        groups: tuple[tuple[QuotaRequest, KeyOf], ...] = ((charge.tenant, quota_key),)
        if region and charge.region is not None:
            groups = ((charge.region, region_key), *groups)
        return _Part(
            groups,
            None if charge.marker is None else (charge.marker, charge.marker_ttl_ms),
            None if charge.reservation is None else (charge.reservation, charge.reservation_ttl_ms),
        )


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

    def _slot_of(self, part: _Part) -> int:
        """The call a part joins: on a cluster, the hash slot of its (last) bucket pair
        (a script's keys must share one); on a single Redis, any."""
        if not self._cluster:
            return 0
        item, key = part.groups[-1]
        return key_slot(key(self._prefix, item.tenant, "requests").encode())

    def _calls(
        self, parts: Sequence[_Part], mode: Literal["take", "adjust"] = "take"
    ) -> list[tuple[_Call, list[int]]]:
        """The script calls deciding ``parts``, each with the indices of its parts."""
        open_calls: dict[int, tuple[_Call, list[int]]] = {}
        calls: list[tuple[_Call, list[int]]] = []
        for index, part in enumerate(parts):
            slot = self._slot_of(part)
            current = open_calls.get(slot)
            if current is None or current[0].size >= CHARGES_PER_CALL:
                current = open_calls[slot] = (_Call(mode), [])
                calls.append(current)
            self._add(current[0], part, mode)
            current[1].append(index)
        return calls

    def _add(self, call: _Call, part: _Part, mode: Literal["take", "adjust"]) -> None:
        buckets: list[tuple[str, float, Limit]] = []
        for item, key in part.groups:
            costs = item.costs
            for d in DIMENSIONS:
                (check_cost if mode == "take" else check_delta)(costs[d])
                buckets.append((key(self._prefix, item.tenant, d), costs[d], item.config.limit(d)))
        call.add(
            buckets, len(DIMENSIONS) if len(part.groups) == 2 else 0, part.marker, part.reservation
        )

    async def _run(
        self, parts: Sequence[_Part], mode: Literal["take", "adjust"] = "take"
    ) -> list[Sequence[bytes | str]]:
        """Each part's reply from the script, in order: one pipelined round trip."""
        calls = self._calls(parts, mode)
        with _store_errors():
            replies = await self._script.many([call.call(self._margin) for call, _ in calls])
        out: list[Sequence[bytes | str] | None] = [None] * len(parts)
        for (_, indices), reply in zip(calls, replies, strict=True):
            for index, one in zip(indices, reply, strict=True):
                out[index] = one
        return cast(list[Sequence[bytes | str]], out)

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
        if self._cluster and any(c.region is not None for c in charges):
            return await self._charge_apart(charges)
        replies = await self._run([_Part.of(c) for c in charges])
        return [self._charged(c, reply) for c, reply in zip(charges, replies, strict=True)]

    async def _charge_apart(self, charges: Sequence[Charge]) -> list[Charged]:
        """On a cluster: the regions first, then the tenants whose region admitted them,
        then the regions given back what a refused or replayed tenant charge did not
        need (module notes)."""
        regional = [i for i, c in enumerate(charges) if c.region is not None]
        region_of: dict[int, QuotaDecision] = {}
        region_parts = [
            _Part(((cast(QuotaRequest, charges[i].region), region_key),)) for i in regional
        ]
        for i, reply in zip(regional, await self._run(region_parts), strict=True):
            outcome, now, _, _, figures = _parse(reply)
            region_of[i] = _decision(cast(QuotaRequest, charges[i].region), outcome, now, figures)
        go = [i for i in range(len(charges)) if i not in region_of or region_of[i].allowed]
        tenant_parts = [_Part.of(charges[i], region=False) for i in go]
        out: list[Charged | None] = [None] * len(charges)
        give_back: list[_Part] = []
        for i, reply in zip(go, await self._run(tenant_parts), strict=True):
            alone = self._charged(replace(charges[i], region=None), reply)
            region = region_of.get(i)
            out[i] = Charged(alone.tenant, region, alone.replayed)
            if region is not None and (not alone.tenant.allowed or alone.replayed):
                item = cast(QuotaRequest, charges[i].region)
                back = replace(item, requests=-item.requests, tokens=-item.tokens)
                give_back.append(_Part(((back, region_key),)))
        for i, region in region_of.items():
            if out[i] is None:  # the region refused: the tenant was not charged
                out[i] = Charged(QuotaDecision("admit", "ok", at=region.at), region, False)
        if give_back:
            await self._run(give_back, "adjust")
        return cast(list[Charged], out)

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
