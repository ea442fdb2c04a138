"""Work claims on a real Redis: one worker at a time generates a request, each start is
a higher generation, a live lease makes others wait, a lapsed one is taken over, and
an answered request is never generated again."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from seawall_client.topics import RedisKeys
from services.common.settings import CommonSettings
from services.workers.claims import Busy, Claimed, Claims, Done, Held

pytestmark = pytest.mark.integration


def claims(redis: aioredis.Redis, settings: CommonSettings, worker: str, lease_s: float) -> Claims:
    return Claims(redis, RedisKeys(settings.redis_prefix), worker, lease_s)


async def test_one_owner_at_a_time_and_an_answered_request_is_done(
    redis: aioredis.Redis, settings: CommonSettings
) -> None:
    a = claims(redis, settings, "w-a", lease_s=5)
    b = claims(redis, settings, "w-b", lease_s=5)
    first = await a.claim("acme", "r1", ttl_s=60)
    assert isinstance(first, Claimed)
    assert first.attempts == 1
    busy = await b.claim("acme", "r1", ttl_s=60)
    assert isinstance(busy, Busy)
    assert busy.owner == "w-a"
    assert 4 < busy.retry_in_s <= 5
    held = Held("acme", "r1", first.generation)
    await a.done(held, ttl_s=60)
    assert await b.claim("acme", "r1", ttl_s=60) == Done(first.generation)
    assert await a.claim("acme", "r1", ttl_s=60) == Done(first.generation)
    ttl = await redis.pttl(RedisKeys(settings.redis_prefix).work("acme", "r1"))
    assert 0 < ttl <= 60_000
    # Another tenant's request of the same id is another request.
    assert isinstance(await b.claim("globex", "r1", ttl_s=60), Claimed)


async def test_a_lapsed_lease_is_taken_over_as_a_higher_generation(
    redis: aioredis.Redis, settings: CommonSettings
) -> None:
    dead = claims(redis, settings, "w-dead", lease_s=0.3)
    survivor = claims(redis, settings, "w-live", lease_s=5)
    first = await dead.claim("acme", "r2", ttl_s=60)
    assert isinstance(first, Claimed)
    assert isinstance(await survivor.claim("acme", "r2", ttl_s=60), Busy)
    await asyncio.sleep(0.4)  # the dead worker renews nothing
    second = await survivor.claim("acme", "r2", ttl_s=60)
    assert isinstance(second, Claimed)
    assert second.generation > first.generation
    assert second.attempts == 2
    # The old owner's lease is gone: it learns so when it renews, and stops.
    assert await dead.renew([Held("acme", "r2", first.generation)]) == [False]
    assert await survivor.renew([Held("acme", "r2", second.generation)]) == [True]


async def test_renewal_keeps_others_waiting_and_release_lets_them_in(
    redis: aioredis.Redis, settings: CommonSettings
) -> None:
    owner = claims(redis, settings, "w-a", lease_s=0.5)
    other = claims(redis, settings, "w-b", lease_s=0.5)
    first = await owner.claim("acme", "r3", ttl_s=60)
    assert isinstance(first, Claimed)
    held = Held("acme", "r3", first.generation)
    for _ in range(4):
        await asyncio.sleep(0.2)
        assert await owner.renew([held]) == [True]
        assert isinstance(await other.claim("acme", "r3", ttl_s=60), Busy)
    await owner.release(held)
    taken = await other.claim("acme", "r3", ttl_s=60)
    assert isinstance(taken, Claimed)
    assert taken.generation > first.generation


async def test_a_restarted_worker_takes_back_what_its_earlier_life_held(
    redis: aioredis.Redis, settings: CommonSettings
) -> None:
    """``seawall up`` restarts a killed worker under the same instance id: what the
    killed process held is taken over at once, as a new generation."""
    before = claims(redis, settings, "worker-main-0", lease_s=30)
    after = claims(redis, settings, "worker-main-0", lease_s=30)
    first = await before.claim("acme", "r4", ttl_s=60)
    second = await after.claim("acme", "r4", ttl_s=60)
    assert isinstance(first, Claimed)
    assert isinstance(second, Claimed)
    assert second.generation > first.generation
