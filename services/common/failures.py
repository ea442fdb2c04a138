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
    redis.exceptions.ConnectionError,  # includes a full pool and BusyLoadingError
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica during failover
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.OutOfMemoryError,
)


class StoreUnavailable(RuntimeError):
    """A service's wrapper for an unreachable store: always infrastructure."""


def is_infrastructure(error: BaseException) -> bool:
    """Whether ``error`` says the broker or Redis is unavailable (retry later) rather
    than that something is wrong with the record in hand."""
    if isinstance(error, UnknownTopicOrPartitionError):
        return False  # a topic the record named: retrying finds it missing again
    if isinstance(error, KafkaError):
        return bool(error.retriable) or isinstance(error, KafkaTimeoutError)
    return isinstance(
        error,
        (*_REDIS_UNREACHABLE, StoreUnavailable, OSError),  # OSError: timeouts too
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
