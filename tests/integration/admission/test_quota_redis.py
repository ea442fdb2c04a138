"""RedisQuota against a real Redis: bucket.lua agrees with the pure model bit for bit,
sets a TTL on every key, and concurrent clients never over-admit."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from schemas import Tier
from seawall_client.topics import RedisKeys
from services.admission.policy.bucket import (
    BucketState,
    Dimension,
    Group,
    Limit,
    QuotaDecision,
    TierConfig,
    adjust,
    charge,
    decide,
    time_until_full,
    ttl_ms,
)
from services.admission.policy.charges import Charge, QuotaRequest
from services.admission.quota import (
    CHARGES_PER_CALL,
    QuotaUnavailable,
    RedisQuota,
    quota_key,
    region_key,
)

pytestmark = pytest.mark.integration

# Small, fast-refilling buckets so that a few milliseconds of sleep matter.
CONFIGS = {
    "basic": TierConfig(Tier.BASIC, Limit(3, 40.0), Limit(500, 4_000.0)),
    "pro": TierConfig(Tier.PRO, Limit(3, 40.0, 2, 20.0), Limit(500, 4_000.0, 300, 1_000.0)),
    "enterprise": TierConfig(Tier.ENTERPRISE, Limit(5.5, 100.0), Limit(800.25, 9_000.5)),
}


async def delete_prefix(client: aioredis.Redis, prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
async def prefix(client: aioredis.Redis) -> AsyncIterator[str]:
    p = f"test:{uuid.uuid4().hex}:"
    yield p
    await delete_prefix(client, p)


async def assert_ttl_covers_refill(
    client: aioredis.Redis, key: str, state: BucketState, limit: Limit
) -> None:
    pttl = await client.pttl(key)
    assert 0 < pttl <= ttl_ms(state, limit)
    assert pttl >= time_until_full(state, limit) * 1000  # the 1 s margin absorbs the delay


ops = st.lists(
    st.tuples(
        st.integers(0, 20),  # ms to sleep first
        st.sampled_from(["take", "take", "take", "adjust"]),
        st.integers(0, 3),  # requests
        st.integers(0, 450),  # tokens
        st.integers(-400, 400),  # adjustment
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.sampled_from(sorted(CONFIGS)), ops)
def test_lua_agrees_with_the_pure_model(
    redis_url: str, tier: str, steps: list[tuple[int, str, int, int, int]]
) -> None:
    asyncio.run(_agreement(redis_url, CONFIGS[tier], steps))


async def _agreement(
    url: str, cfg: TierConfig, steps: list[tuple[int, str, int, int, int]]
) -> None:
    client = aioredis.Redis.from_url(url)
    prefix = f"test:{uuid.uuid4().hex}:"
    quota = RedisQuota(client, prefix)
    states: dict[Dimension, BucketState] = {}
    try:
        for sleep_ms, kind, requests, tokens, delta in steps:
            await asyncio.sleep(sleep_ms / 1000)
            if kind == "take":
                got = await quota.decide("tenant-a", cfg, requests, tokens)
                assert got.at is not None
                want, states = decide(cfg, states, got.at, requests, tokens)
                assert got == want
                touched: list[Dimension] = ["requests", "tokens"]
            else:
                adjusted = await quota.adjust("tenant-a", cfg, delta)
                states["tokens"] = adjust(states.get("tokens"), delta, adjusted.at, cfg.tokens)
                assert adjusted.tokens.state == states["tokens"]
                touched = ["tokens"]
            for d in touched:
                key = quota_key(prefix, "tenant-a", d)
                stored = await client.hgetall(key)
                assert set(stored) == {b"tokens", b"ts", b"burst"}  # one hash per dimension
                await assert_ttl_covers_refill(client, key, states[d], cfg.limit(d))
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


@pytest.mark.parametrize("clients", [1, 4])
async def test_concurrent_clients_never_over_admit(
    redis_url: str, prefix: str, clients: int
) -> None:
    capacity, rate = 10, 200.0
    cfg = TierConfig(Tier.BASIC, Limit(capacity, rate), Limit(1e12, 1e12))
    conns = [aioredis.Redis.from_url(redis_url) for _ in range(clients)]
    decisions: list[QuotaDecision] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + 0.5

    async def hammer(quota: RedisQuota) -> None:
        while loop.time() < stop_at:
            decisions.append(await quota.decide("tenant-b", cfg))

    try:
        await asyncio.gather(*(hammer(RedisQuota(c, prefix)) for c in conns))
    finally:
        for c in conns:
            await c.aclose()
    admitted = sum(1 for d in decisions if d.allowed)
    times = [d.at for d in decisions if d.at is not None]
    elapsed = max(times) - min(times)  # the first decision created the full bucket
    last = min(
        (d for d in decisions if d.at == max(times)),
        key=lambda d: d.dimensions["requests"].state.tokens,
    )
    left = last.dimensions["requests"].state.tokens
    assert admitted >= capacity
    assert any(not d.allowed for d in decisions)
    # Every admission is accounted for: what was admitted plus what is left never
    # exceeds the initial capacity plus the refill over the elapsed server time.
    assert admitted + left <= capacity + rate * elapsed + 1e-6
    assert admitted <= math.floor(capacity + rate * elapsed + 1e-6)


async def test_decide_many_is_one_round_trip_of_atomic_decisions(
    client: aioredis.Redis, prefix: str
) -> None:
    cfg = TierConfig(Tier.BASIC, Limit(5, 0.001), Limit(10_000, 0.001))
    quota = RedisQuota(client, prefix)
    items = [QuotaRequest("a", cfg, 1, 100)] * 7 + [QuotaRequest("b", cfg, 1, 100)] * 2
    got = await quota.decide_many(items)
    assert [d.outcome for d in got] == ["admit"] * 5 + ["reject"] * 2 + ["admit"] * 2
    assert await quota.decide_many([]) == []
    # The pure model, replayed on the script's clock, decides the same.
    states: dict[str, dict[Dimension, BucketState]] = {"a": {}, "b": {}}
    for item, d in zip(items, got, strict=True):
        assert d.at is not None
        want, states[item.tenant] = decide(cfg, states[item.tenant], d.at, 1, 100)
        assert d == want
    assert got[5].headers()["Retry-After"] == str(math.ceil(1 / 0.001))


@pytest.mark.parametrize("by_slot", [False, True], ids=["single", "cluster-grouping"])
async def test_a_large_mixed_batch_is_decided_in_order(
    client: aioredis.Redis, prefix: str, by_slot: bool
) -> None:
    """More charges than one script call holds, over tenants of every tier: several
    calls (grouped by hash slot, as on a cluster, or in order), each with its table of
    limits, decide exactly what the pure model decides charge after charge."""
    quota = RedisQuota(client, prefix)
    quota._cluster = by_slot  # a single Redis accepts any grouping: the decisions must not move
    tenants = [(f"t{i}", CONFIGS[tier]) for i, tier in enumerate(sorted(CONFIGS) * 2)]
    items = [
        QuotaRequest(tenants[i % len(tenants)][0], tenants[i % len(tenants)][1], 1, 20 + i % 7)
        for i in range(3 * CHARGES_PER_CALL + 5)
    ]
    got = await quota.decide_many(items)
    assert {d.outcome for d in got} >= {"admit", "reject"}
    states: dict[str, dict[Dimension, BucketState]] = {t: {} for t, _ in tenants}
    for item, d in zip(items, got, strict=True):
        assert d.at is not None
        want, states[item.tenant] = decide(
            item.config, states[item.tenant], d.at, item.requests, item.tokens
        )
        assert d == want


async def test_adjust_refunds_a_reservation(client: aioredis.Redis, prefix: str) -> None:
    cfg = TierConfig(Tier.BASIC, Limit(5, 0.001), Limit(1_000, 0.001))
    quota = RedisQuota(client, prefix)
    assert (await quota.decide("c", cfg, 1, 900)).allowed
    assert not (await quota.decide("c", cfg, 1, 200)).allowed
    refund = await quota.adjust("c", cfg, -700)  # the reply was 700 tokens shorter
    assert refund.tokens.state.tokens == pytest.approx(800, abs=0.01)
    assert (await quota.decide("c", cfg, 1, 200)).allowed


async def test_cost_validation_happens_before_redis(client: aioredis.Redis, prefix: str) -> None:
    quota = RedisQuota(client, prefix)
    with pytest.raises(ValueError, match="cost"):
        await quota.decide("d", CONFIGS["basic"], requests=-1)
    with pytest.raises(ValueError, match="correction"):
        await quota.adjust("d", CONFIGS["basic"], math.inf)
    assert [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)] == []


async def test_unreachable_redis_raises_quota_unavailable() -> None:
    down = aioredis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    quota = RedisQuota(down, "test:down:")
    cfg = CONFIGS["pro"]
    try:
        with pytest.raises(QuotaUnavailable):
            await quota.decide("e", cfg)
        with pytest.raises(QuotaUnavailable):
            await quota.decide_many([QuotaRequest("e", cfg)])
        with pytest.raises(QuotaUnavailable):
            await quota.adjust("e", cfg, -1)
    finally:
        await down.aclose()


# -- one charge for a region and a tenant, idempotent by request --------------------------

REGION_CFG = TierConfig(Tier.BASIC, Limit(3, 40.0), Limit(1.0, 1.0))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.sampled_from(sorted(CONFIGS)),
    st.lists(
        st.tuples(st.integers(0, 20), st.booleans(), st.integers(0, 450)), min_size=1, max_size=12
    ),
)
def test_a_region_and_tenant_charge_agrees_with_the_pure_model(
    redis_url: str, tier: str, steps: list[tuple[int, bool, int]]
) -> None:
    """Each step charges the tenant, with or without the region's bucket, through the
    script; the pure model (``bucket.charge``) replayed on the script's clock gives the
    same outcomes and states bit for bit: a refused region spends nothing of the tenant
    and a refused tenant nothing of the region."""
    asyncio.run(_charge_agreement(redis_url, CONFIGS[tier], steps))


async def _charge_agreement(url: str, cfg: TierConfig, steps: list[tuple[int, bool, int]]) -> None:
    client = aioredis.Redis.from_url(url)
    prefix = f"test:{uuid.uuid4().hex}:"
    quota = RedisQuota(client, prefix)
    tenant_states: list[BucketState | None] = [None, None]
    region_states: list[BucketState | None] = [None, None]
    try:
        for sleep_ms, with_region, tokens in steps:
            await asyncio.sleep(sleep_ms / 1000)
            region = QuotaRequest("eu", REGION_CFG, 1, 0) if with_region else None
            (got,) = await quota.charge_many([Charge(QuotaRequest("t", cfg, 1, tokens), region)])
            at = got.tenant.at
            assert at is not None
            groups: list[Group] = []
            if with_region:
                groups.append((region_states, [1, 0], [REGION_CFG.requests, REGION_CFG.tokens]))
            groups.append((tenant_states, [1, tokens], [cfg.requests, cfg.tokens]))
            results = charge(groups, at)
            if with_region:
                (r_out, r_takes), results = results[0], results[1:]
                assert got.region is not None
                assert got.region.outcome == r_out
                assert [t.state for t in got.region.dimensions.values()] == [
                    t.state for t in r_takes
                ]
                region_states = [t.state for t in r_takes]
            else:
                assert got.region is None
            ((t_out, t_takes),) = results
            assert got.tenant.outcome == t_out
            assert [t.state for t in got.tenant.dimensions.values()] == [t.state for t in t_takes]
            tenant_states = [t.state for t in t_takes]
            assert not got.replayed
        keys = {k.decode() async for k in client.scan_iter(match=f"{prefix}*", count=1000)}
        if any(r for _, r, _ in steps):
            assert region_key(prefix, "eu", "requests") in keys
        assert quota_key(prefix, "eu", "requests") not in keys  # a tenant named eu is apart
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


async def test_a_charged_request_is_not_charged_again(client: aioredis.Redis, prefix: str) -> None:
    cfg = TierConfig(Tier.BASIC, Limit(2, 0.001), Limit(10_000, 0.001))
    quota = RedisQuota(client, prefix)
    keys = RedisKeys(prefix)

    def charge_of(rid: str) -> Charge:
        return Charge(QuotaRequest("acme", cfg, 1, 10), None, keys.admitted("acme", rid), 5_000)

    first = await quota.charge_many([charge_of("r1"), charge_of("r1"), charge_of("r2")])
    assert [(c.tenant.outcome, c.replayed) for c in first] == [
        ("admit", False),
        ("admit", True),  # the same request again: the same outcome, nothing spent
        ("admit", False),
    ]
    assert first[1].tenant.dimensions["requests"].state.tokens == pytest.approx(1, abs=0.01)
    refused = await quota.charge_many([charge_of("r3"), charge_of("r3")])
    assert [(c.tenant.outcome, c.replayed) for c in refused] == [
        ("reject", False),
        ("reject", True),
    ]
    assert 0 < await client.pttl(keys.admitted("acme", "r1")) <= 5_000
    # A refused region charges no tenant, and the replay remembers the region's refusal.
    region_cfg = TierConfig(Tier.BASIC, Limit(1, 0.001), Limit(1.0, 1.0))
    roomy = TierConfig(Tier.BASIC, Limit(100, 0.001), Limit(100_000, 0.001))

    def regional(rid: str) -> Charge:
        return Charge(
            QuotaRequest("globex", roomy, 1, 10),
            QuotaRequest("eu", region_cfg, 1, 0),
            keys.admitted("globex", rid),
            5_000,
        )

    a, b, b_again = await quota.charge_many([regional("a"), regional("b"), regional("b")])
    assert [c.region.outcome if c.region else None for c in (a, b, b_again)] == [
        "admit",
        "reject",
        "reject",
    ]
    assert b.tenant.dimensions["requests"].state.tokens == pytest.approx(99, abs=0.01)
    assert b_again.replayed


async def test_a_charge_records_its_reservation_in_the_same_step(
    client: aioredis.Redis, prefix: str
) -> None:
    """The tokens charged to the tenant are written to the request's reservation key by
    the script itself: a refused, a replayed or a tokenless charge writes none."""
    cfg = TierConfig(Tier.BASIC, Limit(2, 0.001), Limit(10_000, 0.001))
    quota = RedisQuota(client, prefix)
    keys = RedisKeys(prefix)

    def charge_of(rid: str, tokens: float = 250.5) -> Charge:
        return Charge(
            QuotaRequest("acme", cfg, 1, tokens),
            None,
            keys.admitted("acme", rid),
            5_000,
            keys.reservation("acme", rid),
            7_000,
        )

    charged = await quota.charge_many([charge_of("r1"), charge_of("r2", tokens=0)])
    assert [c.tenant.outcome for c in charged] == ["admit", "admit"]
    assert float(await client.get(keys.reservation("acme", "r1"))) == 250.5
    assert 5_000 < await client.pttl(keys.reservation("acme", "r1")) <= 7_000
    assert await client.get(keys.reservation("acme", "r2")) is None  # nothing reserved
    await client.delete(keys.reservation("acme", "r1"))  # as a completion takes it
    (replayed,) = await quota.charge_many([charge_of("r1")])
    assert replayed.replayed
    assert await client.get(keys.reservation("acme", "r1")) is None  # not written again
    (refused,) = await quota.charge_many([charge_of("r3")])  # the requests bucket is empty
    assert refused.tenant.outcome == "reject"
    assert await client.get(keys.reservation("acme", "r3")) is None
