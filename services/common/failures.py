"""Which failures pause a loop, and which belong to one record — the rule every
consumer loop applies (``services.common.consuming``).

*Infrastructure*: the broker or Redis is unreachable, slow or busy (a connection
refused, a timeout, a full connection pool, a leader election). Nothing is wrong with
the record: the same work is tried again after a backoff, and the loop resumes by
itself when the part answers again.

*The record's own*: anything else — a record too large to forward, a topic a record
named that does not exist, a value the policy code cannot handle, an engine refusing
a prompt. Trying again would fail again, so the record is answered (where a reply
topic allows) or dead-lettered, and its offset moves on.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import redis.exceptions
from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownTopicOrPartitionError

_REDIS_UNREACHABLE = (
    redis.exceptions.ConnectionError,  # refused, reset, a full pool, LOADING, auth
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica during failover
    redis.exceptions.ClusterError,  # CLUSTERDOWN, MASTERDOWN
    redis.exceptions.TryAgainError,  # a slot migrating
    redis.exceptions.AskError,  # MOVED / ASK past redis-py's own redirections
    redis.exceptions.OutOfMemoryError,  # maxmemory with noeviction: writes refused
    redis.exceptions.NoPermissionError,  # an ACL changed under us: every call fails alike
    redis.exceptions.InvalidResponse,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,
)
_UNAVAILABLE_REPLIES = frozenset({"BUSY", "NOREPLICAS", "MISCONF", "LOADING", "OOM"})
"""Error replies redis-py raises as a plain ``ResponseError`` that still say "the
server cannot take this now" (a script running too long, too few replicas, a failed
snapshot refusing writes), whatever the command."""


def redis_unavailable(error: BaseException) -> bool:
    """Whether a Redis error says the store cannot serve now (retry after a backoff, or
    the caller's documented fallback) rather than that the call itself is wrong (a
    cross-slot call, a script error, a wrong type: answered as the request's own error,
    never a reason to stop). Every Redis error is one or the other; none stops a loop."""
    if isinstance(error, _REDIS_UNREACHABLE):
        return True
    if isinstance(error, redis.exceptions.ResponseError):
        return str(error).split(" ", 1)[0] in _UNAVAILABLE_REPLIES
    return False


class StoreUnavailable(RuntimeError):
    """A service's wrapper for an unreachable store: always infrastructure."""


def is_infrastructure(error: BaseException) -> bool:
    """Whether ``error`` says the broker or Redis is unavailable (retry later) rather
    than that something is wrong with the record in hand."""
    if isinstance(error, UnknownTopicOrPartitionError):
        return False  # a topic the record named: retrying finds it missing again
    if isinstance(error, KafkaError):
        return bool(error.retriable) or isinstance(error, KafkaTimeoutError)
    return redis_unavailable(error) or isinstance(
        error,
        (StoreUnavailable, OSError),  # OSError: timeouts too
    )


@dataclass
class Backoff:
    """Exponential backoff with full jitter (a random delay up to ``base_s · 2^n``,
    capped at ``cap_s``), reset by a success. Pure but for the random draw and the
    sleep; the draw is injectable."""

    base_s: float = 0.1
    cap_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("need 0 < base_s <= cap_s")

    def next_delay(self) -> float:
        """The delay before the next try, counting one more failure."""
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures, 30))
        self.failures += 1
        return self.rng.uniform(0, ceiling)

    async def wait(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        self.failures = 0
