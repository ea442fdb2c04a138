"""Scripts by SHA-1 on the real Redis: one round trip a pipeline, and a Redis that lost
its scripts (restarted, flushed) is given them again without the caller noticing."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.common.lua import Lua

pytestmark = pytest.mark.integration

INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


async def test_calls_survive_a_flushed_script_cache_and_run_once_each(
    redis: aioredis.Redis,
) -> None:
    key = f"test:lua:{uuid.uuid4().hex}"
    # a source of its own: no other test's calls can have loaded it
    script = Lua(redis, f"{INCR} -- {uuid.uuid4().hex}")
    try:
        assert await script([key], [1]) == 1  # NOSCRIPT, loaded, sent again
        assert await script.many([([key], [2]), ([key], [3])]) == [3, 6]
        await redis.script_flush()
        assert await script.many([([key], [4]), ([key], [5])]) == [10, 15]
        await redis.script_flush()
        assert await script([key], [10]) == 25
        assert int(await redis.get(key)) == 25  # each call ran exactly once
    finally:
        await redis.delete(key)


async def test_a_script_error_is_raised_not_returned(redis: aioredis.Redis) -> None:
    script = Lua(redis, f"return redis.error_reply('no') -- {uuid.uuid4().hex}")
    with pytest.raises(ResponseError, match="no"):
        await script.many([([], []), ([], [])])
    with pytest.raises(ResponseError, match="no"):
        await script([], [])
