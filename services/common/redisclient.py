"""The one way services make a Redis client: bounded, with timeouts on every call.

- A blocking pool of ``redis_max_connections``: a caller that finds every connection
  busy waits for one (up to ``redis_timeout_s``) instead of failing at once, so a burst
  is back-pressure, not an outage. Loops bound their own fan-out below the pool size
  (``redis_fanout``).
- Connect and socket timeouts of ``redis_timeout_s``: a Redis that stops answering
  costs a caller that long, then counts as unavailable (``failures.is_infrastructure``).
- One immediate retry, for a pooled connection that a Redis restart closed.
- The ACL user and password of ``redis_username`` and ``redis_password_file``, where set.
- A Redis Cluster when the URL says so: ``redis+cluster://host:port`` (or
  ``rediss+cluster://``), any node of it. Every key a script or a transaction touches
  together carries one hash tag (``topics.RedisKeys``), and batches of independent
  calls are split by slot (``admission.quota``, ``exists_each``), so the same code runs
  on one server and on a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from services.common.settings import CommonSettings

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_node_url(url: str) -> str | None:
    """For a cluster URL, the plain URL of the node it names (``None``: not a cluster)."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    return None if plain is None else f"{plain}://{rest}"


def make_redis(settings: CommonSettings) -> aioredis.Redis:
    node = cluster_node_url(settings.redis_url)
    if node is not None:
        cluster = RedisCluster.from_url(
            node,
            **settings.redis_credentials,
            max_connections=settings.redis_max_connections,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        # The same commands under another class: callers use what both implement.
        return cast(aioredis.Redis, cluster)
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        **settings.redis_credentials,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 1),
    )
    return aioredis.Redis.from_pool(pool)


async def exists_each(redis: aioredis.Redis, keys: Sequence[str]) -> list[bool]:
    """Whether each key exists, in one command (``MGET``; on a cluster, one per slot):
    a pipeline of ``EXISTS`` costs the client a command packed and a reply parsed per
    key, a tenth of admission's work on its abort check."""
    if not keys:
        return []
    if isinstance(redis, RedisCluster):
        values = await redis.mget_nonatomic(keys)
    else:
        values = await redis.mget(keys)
    return [v is not None for v in values]


def by_slot(redis: aioredis.Redis, keys: Sequence[str]) -> list[list[str]]:
    """``keys`` in groups that one script call may touch together: all of them on a
    single Redis, one group per hash slot on a cluster."""
    if not isinstance(redis, RedisCluster):
        return [list(keys)] if keys else []
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(key_slot(key.encode()), []).append(key)
    return list(groups.values())
