"""The services' Redis helpers on the real Redis."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from services.common.redisclient import exists_each

pytestmark = pytest.mark.integration


async def test_exists_each_answers_per_key_in_order(redis: aioredis.Redis) -> None:
    keys = [f"test:{uuid.uuid4().hex}:{i}" for i in range(5)]
    try:
        await redis.set(keys[1], b"")  # an empty value still exists
        await redis.set(keys[3], b"1", px=60_000)
        assert await exists_each(redis, keys) == [False, True, False, True, False]
        assert await exists_each(redis, []) == []
    finally:
        await redis.delete(*keys)
