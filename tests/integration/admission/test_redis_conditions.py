"""Admission under the Redis conditions that used to crash-loop it, on real servers: a
Redis at ``maxmemory`` (writes refused with OOM) and a three-node Redis Cluster with a
region throttle in force (a region's keys and a tenant's in different slots). Each
maps to retry, the per-tier fallback, or the request's own error — the service never
stops — and the region and tenant buckets hold on the cluster."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from schemas import DispatchedRequest, Priority, ReasonCode, RegionThrottle, ReplyStatus, Tier
from seawall_client.topics import RedisKeys, Topics
from services.admission.policy.bucket import Limit, TierConfig
from services.admission.policy.charges import Charge, QuotaRequest
from services.admission.quota import RedisQuota, quota_key, region_key
from services.admission.service import Admission
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    apply_control,
    capacity_feed,
    control_common,
    inference_request,
    send_all,
)
from tests.conftest import private_redis
from tests.fleet import ReplyReader
from tests.rediscluster import redis_cluster

pytestmark = pytest.mark.integration


# -- maxmemory ------------------------------------------------------------------------


@pytest.fixture
def full_redis(tmp_path: Path) -> Iterator[str]:
    """A private Redis (filled by ``fill``: ``noeviction``, every write refused)."""
    with private_redis(tmp_path) as url:
        yield url


async def fill(url: str) -> None:
    """Write until Redis refuses: maxmemory just above what it holds, no eviction."""
    client = aioredis.Redis.from_url(url)
    try:
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", str(used + 512 * 1024))
        blob = b"x" * 16_384
        for i in range(10_000):
            try:
                await client.set(f"ballast:{i}", blob)
            except redis.exceptions.OutOfMemoryError:
                return
        raise AssertionError("Redis never refused a write")
    finally:
        await client.aclose()


@asynccontextmanager
async def admission_on(
    settings: CommonSettings, topics: Topics, redis_url: str
) -> AsyncIterator[tuple[Admission, ReplyReader, TopicReader]]:
    """Admission on ``redis_url``, a reader of its replies and of the main pool's
    dispatches, and a fake main worker of 100 slots; admission must not have failed."""
    s = admission_settings(settings.model_copy(update={"redis_url": redis_url}))
    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main")) as reader,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        yield admission, client, reader
        assert not admission.failed.is_set()


async def decided(
    topics: Topics,
    client: ReplyReader,
    reader: TopicReader,
    enough: Callable[[dict[str, DispatchedRequest]], bool],
) -> dict[str, DispatchedRequest]:
    """The main pool's dispatches by request id, once ``enough`` says so (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        await reader.poll()
        await client.poll(50)
        sent = {d.request.request_id: d for d in reader.dispatched(topics.dispatch("main"))}
        if enough(sent):
            return sent
        assert time.monotonic() < deadline, (sorted(sent), sorted(client.terminals))


async def test_at_maxmemory_each_tier_gets_its_fallback_and_admission_carries_on(
    settings: CommonSettings, topics: Topics, full_redis: str
) -> None:
    await fill(full_redis)
    async with admission_on(settings, topics, full_redis) as (_, client, reader):
        by_tier = {
            Tier.ENTERPRISE: Priority.VIP,
            Tier.PRO: Priority.STANDARD,
            Tier.BASIC: Priority.BULK,
        }
        for round_ in range(2):  # the second: the first did not stop anything
            for tier, cls in by_tier.items():
                req = inference_request(f"{tier.value}-{round_}", client.topic, tier=tier)
                await send_all(settings, topics.requests(cls), [req])
        dispatched = await decided(
            topics, client, reader, lambda sent: len(sent) >= 4 and len(client.terminals) >= 2
        )

    for round_ in range(2):
        assert not dispatched[f"enterprise-{round_}"].degradation.quota_degraded  # open
        assert dispatched[f"pro-{round_}"].degradation.quota_degraded  # open, degraded
        (basic,) = client.terminals[f"basic-{round_}"]  # fails closed
        assert (basic.status, basic.reason) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_UNAVAILABLE)
        assert basic.rate_limit is not None
        assert basic.rate_limit.retry_after_s > 0


# -- Redis Cluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield f"redis+cluster://127.0.0.1:{ports[0]}"


@pytest.fixture
async def cluster(cluster_url: str) -> AsyncIterator[aioredis.Redis]:
    client = RedisCluster.from_url(cluster_url.replace("redis+cluster", "redis"))
    yield client  # type: ignore[misc]
    await client.aclose()


async def test_region_and_tenant_buckets_on_a_cluster_keep_their_one_step_outcomes(
    cluster: aioredis.Redis,
) -> None:
    """Charged in two steps on a cluster, a region and a tenant end as the single-Redis
    script leaves them: a refused region charges no tenant, a refused tenant and a
    replayed request cost the region nothing."""
    prefix = f"test:{uuid.uuid4().hex}:"
    keys = RedisKeys(prefix)
    quota = RedisQuota(cluster, prefix)
    region = TierConfig(Tier.BASIC, Limit(2, 0.001), Limit(1e6, 0.001))
    one = TierConfig(Tier.BASIC, Limit(1, 0.001), Limit(1e6, 0.001))
    roomy = TierConfig(Tier.BASIC, Limit(100, 0.001), Limit(1e6, 0.001))

    def charge(tenant: str, rid: str, cfg: TierConfig) -> Charge:
        return Charge(
            QuotaRequest(tenant, cfg, 1, 10),
            QuotaRequest("eu", region, 1, 0),
            keys.admitted(tenant, rid),
            60_000,
        )

    async def region_left() -> float:
        state = await cluster.hget(region_key(prefix, "eu", "requests"), "tokens")
        return float(state) if state is not None else region.requests.capacity

    try:
        # Tenant "solo" has one request: its second is refused, and the region keeps it.
        a, b = await quota.charge_many([charge("solo", "a", one), charge("solo", "b", one)])
        assert (a.tenant.outcome, a.region and a.region.outcome) == ("admit", "admit")
        assert (b.tenant.outcome, b.region and b.region.outcome) == ("reject", "admit")
        assert await region_left() == pytest.approx(1, abs=0.01)
        # The same request again: replayed, the region given back.
        (again,) = await quota.charge_many([charge("solo", "a", one)])
        assert again.replayed
        assert again.tenant.outcome == "admit"
        assert await region_left() == pytest.approx(1, abs=0.01)
        # The region's last request, then a refusal that charges no tenant.
        c, d = await quota.charge_many([charge("acme", "c", roomy), charge("globex", "d", roomy)])
        assert (c.tenant.outcome, c.region and c.region.outcome) == ("admit", "admit")
        assert d.region is not None
        assert d.region.outcome == "reject"
        assert await cluster.exists(quota_key(prefix, "globex", "requests")) == 0
        assert await cluster.exists(keys.admitted("globex", "d")) == 0
    finally:
        for k in [k async for k in cluster.scan_iter(match=f"{prefix}*")]:
            await cluster.delete(k)


async def test_admission_on_a_cluster_with_a_region_throttle_in_force(
    settings: CommonSettings, topics: Topics, cluster_url: str
) -> None:
    async with admission_on(settings, topics, cluster_url) as (admission, client, reader):
        slow_eu = RegionThrottle(**control_common("region:eu", 1), region="eu", rate_per_s=1)
        await apply_control(settings, topics, admission.control, slow_eu)
        eu = [
            inference_request(f"eu-{i}", client.topic, tenant=f"t{i}", region="eu")
            for i in range(4)
        ]
        us = inference_request("us-0", client.topic, tenant="t0", region="us")
        await send_all(settings, topics.requests(Priority.STANDARD), [*eu, us])
        dispatched = await decided(
            topics, client, reader, lambda sent: len(set(sent) | set(client.terminals)) >= 5
        )

    assert "us-0" in dispatched
    throttled = [r.request_id for r in eu if r.request_id not in dispatched]
    assert 1 <= len(dispatched) - 1 < 4  # the region's bucket held some of them back
    for rid in throttled:
        (reply,) = client.terminals[rid]
        assert reply.reason is ReasonCode.REGION_THROTTLED
